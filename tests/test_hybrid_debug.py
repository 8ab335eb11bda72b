"""FastGen hybrid caches and debug_<strategy> attention-loss analysis."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import strategies.hybrid as hybrid_module
from cache_args import add_tokenizer_kwargs, check_compatibility, default_cache_kwargs
from generation import generate
from strategies.hybrid import HybridCache, observation_attention, parse_hybrid_policy

ROOT = Path(__file__).resolve().parent.parent
SPECIAL, PUNC, WORD = 0, 1, 2


def profiled_cache(attn: torch.Tensor, token_ids: torch.Tensor, min_recovery_frac: float = 0.9) -> HybridCache:
    """A hybrid cache prefilled with a prompt of `token_ids` whose observed attention is the hand-made [1, H, W, T]."""
    n_heads, seqlen = attn.shape[1], attn.shape[-1]
    hybrid_module.observation_attention = lambda query, k, window: attn
    cache = HybridCache(1, n_heads, 8, 2 * seqlen, torch.float32, global_tokens=1,
                        min_recovery_frac=min_recovery_frac, special_ids=[SPECIAL], punctuation_ids=[PUNC])  # fmt: skip
    k = torch.randn(1, n_heads, seqlen, 8)
    query = torch.randn(1, n_heads, seqlen, 8)
    try:
        cache.update_kv(torch.arange(seqlen), k, k, is_prefill=True, query=query, token_ids=token_ids.view(1, -1))
    finally:
        hybrid_module.observation_attention = observation_attention
    return cache


def test_profiling_picks_the_cheapest_policy_that_recovers_enough():
    seqlen = 20
    ids = torch.full((seqlen,), WORD)
    ids[0] = SPECIAL
    ids[[5, 10]] = PUNC
    attn = torch.zeros(1, 5, 1, seqlen)
    attn[0, 0, 0, 0] = 1.0  # all on the special token -> special
    attn[0, 1, 0, [0, 5, 10]] = torch.tensor([0.3, 0.35, 0.35])  # special + punctuation -> special_punc
    attn[0, 2, 0, [0, 5, 7]] = torch.tensor([0.1, 0.1, 0.8])  # one heavy word token -> ..._heavy_hitter
    attn[0, 3, 0, 0] = 0.1  # spread over more tokens than heavy hitters keep, the recent ones too -> ..._window
    attn[0, 3, 0, 8:14] = 0.08
    attn[0, 3, 0, 14:20] = 0.07
    attn[0, 4, 0] = 1.0 / seqlen  # uniform: no compressing policy recovers 90% -> full
    cache = profiled_cache(attn, ids)
    names = [cache.strategies[i] if i < len(cache.strategies) else "full" for i in cache.policy[0].tolist()]
    assert names == ["special", "special_punc", "special_punc_heavy_hitter", "special_punc_heavy_hitter_window", "full"]
    kept = (cache.kept & (cache.pos >= 0))[0].sum(-1).tolist()
    assert kept[0] == 2 and kept[1] == 4 and kept[4] == seqlen  # the newest token always stays
    assert kept[0] < kept[1] < kept[2] < kept[3] < kept[4]


def test_lower_recovery_target_picks_cheaper_policies():
    seqlen = 20
    ids = torch.full((seqlen,), WORD)
    ids[0] = SPECIAL
    attn = torch.zeros(1, 1, 1, seqlen)
    attn[0, 0, 0, 0] = 0.6
    attn[0, 0, 0, 1:] = 0.4 / (seqlen - 1)
    assert profiled_cache(attn, ids, 0.9).policy.item() == 4  # only full recovers 90%
    assert profiled_cache(attn, ids, 0.5).policy.item() == 0  # the special token alone recovers 60%


def test_unknown_hybrid_policy_is_rejected():
    assert parse_hybrid_policy("special_punc_heavy_hitter_window") == {"special", "punc", "heavy_hitter", "window"}
    with pytest.raises(ValueError, match="unknown hybrid policy 'special_pun'"):
        parse_hybrid_policy("special_pun")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cache_strategy", "hybrid", "--compile"], "cannot be compiled"),
        (["--cache_strategy", "hybrid", "--max_cache_length", "0.5"], "hybrid cache spans the whole sequence"),
        (["--cache_config", str(ROOT / "tests" / "data" / "hybrid_bad_policy.yaml")], "unknown hybrid policy"),
    ],
)
def test_hybrid_bad_input_is_one_line_error(args, message):
    result = subprocess.run([sys.executable, "generate.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_debug_strategies_pass_the_compatibility_check():
    check_compatibility(default_cache_kwargs(cache_strategy=["debug_heavy_hitter"], max_cache_length=[0.25],
                                             prompt_compression_strategy=["heavy_hitter"]), 30)  # fmt: skip
    with pytest.raises(ValueError, match="unknown cache strategy"):
        check_compatibility(default_cache_kwargs(cache_strategy=["debug_nope"]))


# -- on the embedded model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from generation import load_model
    from tokenizer import get_tokenizer

    checkpoint = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
    return load_model(checkpoint, "cpu", torch.float32), get_tokenizer(checkpoint)


def chat_ids(tokenizer, prompt_file: str) -> torch.Tensor:
    text = (ROOT / "prompts" / prompt_file).read_text()
    return torch.tensor(tokenizer.encode(tokenizer.apply_chat_template(text)))


def run(model, tokenizer, ids, max_new_tokens, **cache_kwargs):
    kwargs = add_tokenizer_kwargs(default_cache_kwargs(**cache_kwargs), tokenizer)
    check_compatibility(kwargs, model.config.n_layer)
    torch.manual_seed(0)
    return generate(model, ids, max_new_tokens, kwargs)


@pytest.mark.slow
def test_hybrid_recovery_target_trades_tokens_for_compression(smollm2):
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "lighthouse_summary.txt")
    full_tokens, _ = run(model, tokenizer, ids, 12)
    ratios = []
    for frac in (1.0, 0.9, 0.7, 0.5):
        tokens, stats = run(model, tokenizer, ids, 12, cache_strategy=["hybrid"], min_recovery_frac=frac)
        ratios.append(stats["compression_ratio"])
        if frac == 1.0:
            assert stats["compression_ratio"] == 0.0
            assert tokens.tolist() == full_tokens.tolist()
    assert ratios == sorted(ratios), ratios  # a lower target never compresses less
    compressing = 1.0 - stats["policy_share"]["full"]
    assert compressing > 0.5, stats["policy_share"]


@pytest.mark.slow
def test_debug_attention_loss(smollm2):
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "long_niah.txt")
    full_tokens, _ = run(model, tokenizer, ids, 8)

    tokens, stats = run(model, tokenizer, ids, 8, cache_strategy=["debug_recent_global"])
    assert stats["attention_loss"] == 0.0  # budget 1.0 evicts nothing
    assert tokens.tolist() == full_tokens.tolist()

    losses = {}
    for budget in (0.5, 0.25, 0.1):
        tokens, stats = run(model, tokenizer, ids, 8, cache_strategy=["debug_recent_global"], max_cache_length=[budget])
        assert tokens.tolist() == full_tokens.tolist()  # attends with the full cache
        losses[budget] = stats["attention_loss"]
    assert 0 < losses[0.5] < losses[0.25] < losses[0.1], losses

    def loss(strategy):
        _, stats = run(model, tokenizer, ids, 8, cache_strategy=[f"debug_{strategy}"], max_cache_length=[0.1],
                       prompt_compression_strategy=["heavy_hitter" if strategy == "heavy_hitter" else "random"])  # fmt: skip
        return stats["attention_loss"]

    assert loss("heavy_hitter") < loss("random")


@pytest.mark.slow
def test_attention_loss_plot_has_one_labelled_line_per_strategy(tmp_path):
    out = tmp_path / "loss.png"
    result = subprocess.run(
        [sys.executable, "scripts/plot_attention_loss.py", "--prompt", "lighthouse_summary.txt", "--strategies",
         "recent_global", "heavy_hitter", "--max_new_tokens", "6", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        "recent_global: mean attention loss" in result.stdout and "heavy_hitter: mean attention loss" in result.stdout
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--cache_strategy", "debug_heavy_hitter", "--prompt_compression_strategy", "heavy_hitter",
             "--max_cache_length", "0.25", "--prompt", "lighthouse_summary.txt"],
            [r"^attention loss: 0\.\d{4}$", r"^attention loss per layer: (0\.\d{4} ){29}0\.\d{4}$"],
        ),
        (
            ["--cache_strategy", "hybrid", "--min_recovery_frac", "0.7", "--prompt", "lighthouse_summary.txt"],
            [r"^policy share: special \d\.\d{4}, special_punc \d\.\d{4}, .*full \d\.\d{4}$"],
        ),
    ],
    ids=["debug_heavy_hitter", "hybrid"],
)  # fmt: skip
def test_generate_prints_every_statistic_the_caches_report(argv, expected, capsys):
    """What a strategy reports beyond compression and memory prints by name, with no edit to generate.py."""
    import re

    import generate

    generate.main([*argv, "--max_new_tokens", "6", "--dtype", "float32"])
    out = capsys.readouterr().out
    for pattern in expected:
        assert re.search(pattern, out, re.MULTILINE), f"{pattern!r} not in:\n{out}"
