"""Plots the attention loss over decode steps of several strategies on one prompt (debug_<strategy> runs).

    python scripts/plot_attention_loss.py --prompt long_niah.txt --strategies recent_global heavy_hitter random \
        --max_cache_length 0.25 --max_new_tokens 64 --out attention_loss.png
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import strategies  # noqa: E402
from cache_args import check_compatibility, default_cache_kwargs  # noqa: E402
from generate import read_prompt  # noqa: E402
from generation import DEFAULT_CHECKPOINT, CheckpointError, generate, load_model, resolve_device, resolve_dtype  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402


def attention_loss_curves(model, prompt_ids, names, max_cache_length, max_new_tokens) -> dict[str, list[float]]:
    """Per-step attention loss (mean over layers) of each strategy, fed the same full-cache tokens."""
    curves = {}
    for strategy in names:
        kwargs = default_cache_kwargs(
            cache_strategy=[strategies.DEBUG_PREFIX + strategy],
            prompt_compression_strategy=[strategies.natural_compressor(strategy)],
            max_cache_length=[max_cache_length],
        )
        check_compatibility(kwargs, model.config.n_layer)
        torch.manual_seed(0)
        generate(model, prompt_ids, max_new_tokens, kwargs)
        caches = [layer.attention.kv_cache for layer in model.layers]
        steps = int(caches[0].steps[0])  # one sequence: row 0
        curves[strategy] = torch.stack([c.attention_loss[0, :steps] for c in caches]).mean(0).tolist()
    return curves


def plot(curves: dict[str, list[float]], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for strategy, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=strategy)
    ax.set_xlabel("decode step")
    ax.set_ylabel("attention loss (mass on evicted tokens)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="long_niah.txt")
    parser.add_argument("--strategies", nargs="+", default=strategies.compressing_strategies(),
                        help="strategies to simulate (default: every compressing strategy)")  # fmt: skip
    parser.add_argument("--max_cache_length", type=float, default=0.25)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("attention_loss.png"))
    args = parser.parse_args()
    try:
        tokenizer = get_tokenizer(args.checkpoint_path)
        prompt = read_prompt(args.prompt)
        text = tokenizer.apply_chat_template(prompt) if tokenizer.is_chat else prompt
        model = load_model(args.checkpoint_path, resolve_device(args.device), resolve_dtype(args.dtype))
        prompt_ids = torch.tensor(tokenizer.encode(text))
        curves = attention_loss_curves(model, prompt_ids, args.strategies, args.max_cache_length, args.max_new_tokens)
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    plot(curves, f"{args.prompt}, budget {args.max_cache_length}", args.out)
    for strategy, losses in curves.items():
        print(f"{strategy}: mean attention loss {sum(losses) / len(losses):.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
