"""Tensor parallel (tp.py): sharding math in-process, and torchrun with gloo against one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tp
from attention import precompute_freqs_cis
from cache_args import default_cache_kwargs
from generation import generate, load_model
from model import ModelArgs, Transformer
from tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parent.parent
# ~64 tokens with the SmolLM2 tokenizer: a cache of 32 slots keeps half of it.
PROMPT = (
    "The quick brown fox jumps over the lazy dog. A cold compress is a cloth soaked in cold water and "
    "pressed on the skin to reduce swelling, numb pain and cool a fever. Researchers compress the key "
    "value cache of language models to save memory while keeping quality, one evicted token at a time."
)
BUDGET = 32  # slots per layer: forces prompt compression and evictions at every decode step
MAX_NEW_TOKENS = 16
STRATEGIES = {  # strategy: (cache length, prompt compressor)
    "full": (1.0, "full"),
    "recent_global": (BUDGET, "recent_global"),
    "heavy_hitter": (BUDGET, "heavy_hitter"),
}


def make_tiny_checkpoint(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint folder (model.pth + config.json + the SmolLM2 tokenizer files).

    The vocabulary is SmolLM2's (49152) so real prompts tokenize; attention is sharpened (scaled
    q/k/v and output weights) so that which tokens a cache keeps changes the greedy output.
    """
    config = dict(
        block_size=1024, vocab_size=49152, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128
    )
    args = ModelArgs(**{**config, "tie_embeddings": True, **overrides})
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wqkv.weight.mul_(4.0)
            layer.attention.wo.weight.mul_(3.0)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / "model.pth")
    args.to_json(folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def tiny_checkpoint(smollm2_checkpoint, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "tiny-tp", smollm2_checkpoint)


def torchrun(*args: str, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---- in-process: the sharding itself --------------------------------------------------------


def test_check_tp_names_the_kv_heads():
    with pytest.raises(ValueError, match=r"KV-head count \(n_local_heads=3\) to be divisible by the world size"):
        tp.check_tp(ModelArgs(n_layer=1, n_head=6, n_local_heads=3, dim=96, intermediate_size=128), 2)
    with pytest.raises(ValueError, match="MLP hidden size"):
        tp.check_tp(ModelArgs(n_layer=1, n_head=4, n_local_heads=2, dim=64, intermediate_size=129), 2)
    tp.check_tp(ModelArgs(n_layer=1, n_head=4, n_local_heads=2, dim=64, intermediate_size=128), 2)


@pytest.mark.parametrize("attention_bias", [False, True])
def test_shards_sum_to_the_full_layer(attention_bias):
    """Each rank's attention (its query heads over its KV heads) and MLP (its hidden units) add up to
    the unsharded layer: what the all-reduce after wo and w2 computes."""
    torch.manual_seed(0)
    config = ModelArgs(
        n_layer=1, n_head=8, n_local_heads=4, dim=64, intermediate_size=96, attention_bias=attention_bias
    )
    block = Transformer(config).layers[0].float().eval()
    x = torch.randn(1, 7, config.dim)
    input_pos = torch.arange(7)
    freqs_cis = precompute_freqs_cis(16, config.head_dim, config.rope_base)[input_pos]
    with torch.no_grad():
        expected_attn = block.attention(x, freqs_cis, input_pos, is_prefill=True)
        expected_mlp = block.feed_forward(x)
        for size in (2, 4):
            attn_sum, mlp_sum = 0, 0
            for rank in range(size):
                shard = Transformer(config).layers[0].float().eval()
                shard.load_state_dict(block.state_dict())
                tp._shard_attention(shard.attention, rank, size)
                tp._shard_feed_forward(shard.feed_forward, rank, size)
                assert shard.attention.n_local_heads == config.n_local_heads // size
                assert shard.attention.n_head == config.n_head // size
                attn_sum = attn_sum + shard.attention(x, freqs_cis, input_pos, is_prefill=True)
                mlp_sum = mlp_sum + shard.feed_forward(x)
            torch.testing.assert_close(attn_sum, expected_attn, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mlp_sum, expected_mlp, rtol=1e-5, atol=1e-5)


def test_single_process_is_untouched(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert tp.maybe_init_dist("cpu") is None
    model = Transformer(ModelArgs(n_layer=1, n_head=4, n_local_heads=2, dim=64, intermediate_size=128))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tp.apply_tp(model, rank=0, size=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert tp.all_reduce_statistics({"compression_ratio": 0.5}) == {"compression_ratio": 0.5}


# ---- torchrun with gloo ---------------------------------------------------------------------

WORKER = """
import json, sys
import torch
sys.path.insert(0, {root!r})
import tp
from cache_args import default_cache_kwargs
from generation import generate, load_model
from tokenizer import get_tokenizer

checkpoint, out = sys.argv[1], sys.argv[2]
rank = tp.maybe_init_dist("cpu")
model = load_model(checkpoint, torch.device("cpu"), torch.float32, shard=tp.apply_tp if rank is not None else None)
prompt_ids = torch.tensor(get_tokenizer(checkpoint).encode({prompt!r}))
results = {{}}
for strategy, (length, compressor) in {strategies!r}.items():
    kwargs = default_cache_kwargs(cache_strategy=[strategy], prompt_compression_strategy=[compressor],
                                  max_cache_length=[float(length)], global_tokens=2, recent_window=4)
    tokens, stats = generate(model, prompt_ids, {max_new_tokens}, kwargs)
    stats = tp.all_reduce_statistics(stats)
    results[strategy] = dict(tokens=tokens.tolist(), compression_ratio=stats["compression_ratio"],
                             cache_memory_bytes=stats["cache_memory_bytes"],
                             local_kv_heads=model.layers[0].attention.n_local_heads)
if not rank:
    json.dump(results, open(out, "w"))
tp.maybe_destroy_dist()
"""


def single_process_results(checkpoint: Path) -> dict:
    model = load_model(checkpoint, torch.device("cpu"), torch.float32)
    prompt_ids = torch.tensor(get_tokenizer(checkpoint).encode(PROMPT))
    assert 56 <= prompt_ids.numel() <= 72, prompt_ids.numel()
    results = {}
    for strategy, (length, compressor) in STRATEGIES.items():
        kwargs = default_cache_kwargs(
            cache_strategy=[strategy],
            prompt_compression_strategy=[compressor],
            max_cache_length=[float(length)],
            global_tokens=2,
            recent_window=4,
        )
        tokens, stats = generate(model, prompt_ids, MAX_NEW_TOKENS, kwargs)
        results[strategy] = dict(
            tokens=tokens.tolist(),
            compression_ratio=stats["compression_ratio"],
            cache_memory_bytes=stats["cache_memory_bytes"],
        )
    return results


@pytest.mark.slow
def test_torchrun_two_ranks_gives_the_same_greedy_tokens(tiny_checkpoint, tmp_path):
    script = tmp_path / "tp_worker.py"
    script.write_text(
        WORKER.format(root=str(ROOT), prompt=PROMPT, strategies=STRATEGIES, max_new_tokens=MAX_NEW_TOKENS)
    )
    out = tmp_path / "tp.json"
    result = torchrun(str(script), str(tiny_checkpoint), str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    parallel = json.loads(out.read_text())
    single = single_process_results(tiny_checkpoint)
    for strategy in STRATEGIES:
        assert parallel[strategy]["local_kv_heads"] == 1  # 2 KV heads over 2 ranks
        assert parallel[strategy]["tokens"] == single[strategy]["tokens"], strategy
        assert parallel[strategy]["compression_ratio"] == pytest.approx(single[strategy]["compression_ratio"]), strategy
        # Per-head buffers split exactly; a cache's scalar buffers exist once per rank.
        assert parallel[strategy]["cache_memory_bytes"] == pytest.approx(
            single[strategy]["cache_memory_bytes"], rel=0.01
        )
    # The budget really evicts, and what is evicted changes the output.
    assert single["heavy_hitter"]["compression_ratio"] > 0.4
    assert single["heavy_hitter"]["tokens"] != single["full"]["tokens"]
    assert single["recent_global"]["tokens"] != single["heavy_hitter"]["tokens"]


@pytest.mark.slow
def test_torchrun_generate_py_prints_once_and_matches(tiny_checkpoint):
    args = ["--checkpoint_path", str(tiny_checkpoint), "--prompt", PROMPT, "--no_chat_template", "--dtype", "float32"]
    args += ["--max_new_tokens", str(MAX_NEW_TOKENS), "--cache_strategy", "heavy_hitter", "--max_cache_length"]
    args += [str(BUDGET), "--prompt_compression_strategy", "heavy_hitter", "--global_tokens", "2", "--recent_window", "4"]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    single = subprocess.run(
        [sys.executable, "generate.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert single.returncode == 0, single.stderr
    parallel = torchrun("generate.py", *args)
    assert parallel.returncode == 0, parallel.stdout + parallel.stderr

    def lines(stdout: str) -> dict:
        out = [line for line in stdout.splitlines() if line.strip()]
        return {
            "text": out[0],
            **{line.split(":")[0]: line for line in out if line.startswith(("compression", "cache"))},
        }

    text_line = lines(single.stdout)["text"]
    assert parallel.stdout.count(text_line) == 1  # only rank 0 prints
    assert lines(parallel.stdout) == lines(single.stdout)


@pytest.mark.slow
def test_torchrun_kv_heads_not_divisible_is_one_clear_error(smollm2_checkpoint, tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny-3kv", smollm2_checkpoint, n_head=6, n_local_heads=3, dim=96)
    result = torchrun("generate.py", "--checkpoint_path", str(checkpoint), "--prompt", "hello", "--max_new_tokens", "2")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: tensor parallel over 2 processes needs the KV-head count (n_local_heads=3) to be divisible by the "
        "world size; use a --nproc_per_node that divides 3"
    ]
