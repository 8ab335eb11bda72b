"""Cache strategies end to end: eviction, generation and statistics.

* slow, on the embedded SmolLM2-135M-Instruct: every strategy at --max_cache_length 1.0 reproduces the
  full-cache greedy output (bfloat16, the CLI default, is exact here); statistics of a ~1,500-token
  needle-in-a-haystack run at a 25% budget equal the statistics worked by hand; an 8-bit cache gives
  the unquantized greedy output (float32: in bfloat16 the two drift apart) and a
  4-bit cache's memory counts packed bytes; compiled bfloat16 decode gives eager's logits bit for bit.
* fast, on a tiny random model: generation with compressed caches of every strategy runs and keeps
  its budget; `--compile` gives the eager tokens (float32, and bfloat16 with a full cache).
"""

import csv
import json
import math

import pytest
import torch
from helpers import packed_copies, tiny_prompt, tiny_transformer

import cpu_backend
import generate as generate_cli
import generation
from cache_args import default_cache_kwargs
from cpu_backend import ONEDNN_PACKS_BFLOAT16, CPULinear
from generation import DEFAULT_CHECKPOINT, load_model
from model import RMSNorm
from tokenizer import get_tokenizer

SHORT_PROMPT = "What is a cold compress?"
NEW_TOKENS = 24

AT_FULL_LENGTH = {
    "full": dict(cache_strategy=["full"], prompt_compression_strategy=["full"]),
    "recent_global": dict(cache_strategy=["recent_global"]),
    "random": dict(cache_strategy=["random"], prompt_compression_strategy=["random"]),
    "l2": dict(cache_strategy=["l2"], prompt_compression_strategy=["l2"]),
    "heavy_hitter": dict(cache_strategy=["heavy_hitter"], prompt_compression_strategy=["heavy_hitter"]),
    "heavy_hitter_window4": dict(
        cache_strategy=["heavy_hitter"], prompt_compression_strategy=["heavy_hitter"], history_window_size=4
    ),
    "heavy_hitter_thresholding": dict(
        cache_strategy=["heavy_hitter"], prompt_compression_strategy=["heavy_hitter"], attn_thresholding=True
    ),
    "keep_it_odd": dict(cache_strategy=["keep_it_odd"], prompt_compression_strategy=["keep_it_odd"]),
}


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(DEFAULT_CHECKPOINT)


@pytest.fixture(scope="module")
def short_prompt_ids(tokenizer):
    return torch.tensor(tokenizer.encode(tokenizer.apply_chat_template(SHORT_PROMPT)))


@pytest.fixture(scope="module")
def model_bf16():
    return load_model(DEFAULT_CHECKPOINT, "cpu", torch.bfloat16)


@pytest.fixture(scope="module")
def model_fp32():
    return load_model(DEFAULT_CHECKPOINT, "cpu", torch.float32)


def run(model, prompt_ids, tokenizer, n=NEW_TOKENS, **cache_overrides):
    torch.manual_seed(0)
    tokens, stats = generation.generate(
        model, prompt_ids, n, default_cache_kwargs(**cache_overrides), terminator_ids=tokenizer.terminator_ids
    )
    return tokens.tolist(), stats


@pytest.fixture(scope="module")
def full_output_bf16(model_bf16, short_prompt_ids, tokenizer):
    tokens, stats = run(model_bf16, short_prompt_ids, tokenizer, **AT_FULL_LENGTH["full"])
    assert len(tokens) == NEW_TOKENS, "the reference must not stop early, or the comparison is too short"
    assert "cold" in tokenizer.decode(tokens)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in AT_FULL_LENGTH if n != "full"])
def test_every_strategy_at_full_length_matches_full_cache(
    name, model_bf16, short_prompt_ids, tokenizer, full_output_bf16
):
    tokens, stats = run(model_bf16, short_prompt_ids, tokenizer, **AT_FULL_LENGTH[name])
    assert tokens == full_output_bf16, tokenizer.decode(tokens)
    assert stats["compression_ratio"] == 0.0


# -- statistics on the needle-in-a-haystack prompt ----------------------------------------------------
def expected_layer_bytes(strategy, cache_len, n_kv, head_dim, elem, bits=None, history_window_size=1):
    """Bytes of every buffer of one layer's cache, from shapes and dtypes."""
    slots = n_kv * cache_len
    if bits is None:
        kv = 2 * slots * head_dim * elem  # k_cache, v_cache
    else:
        kv = 2 * (slots * head_dim * bits // 8 + 2 * slots * elem)  # packed codes + scale + zero point
    total = kv + slots * 4  # pos (int32)
    if strategy == "heavy_hitter":
        total += slots * history_window_size * 4 + slots * 4 + 8  # history, counter (float32), step (int64)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("bits", [None, 4])
def test_needle_in_a_haystack_statistics_by_hand(bits, tmp_path, capsys):
    """Layers 0-14 recent_global, 15-29 heavy_hitter (tile), 25% budget, through generate.py --csv."""
    csv_path = tmp_path / "stats.csv"
    max_new = 4
    argv = [
        "--prompt", "long_niah.txt", "--max_cache_length", "0.25", "--max_new_tokens", str(max_new),
        "--cache_strategy", "recent_global", "heavy_hitter",
        "--prompt_compression_strategy", "recent_global", "heavy_hitter",
        "--global_tokens", "4", "--device", "cpu", "--csv", str(csv_path),
    ]  # fmt: skip
    if bits:
        argv += ["--cache_bits", str(bits)]
    generate_cli.main(argv)
    out = capsys.readouterr().out
    (row,) = list(csv.DictReader(csv_path.open()))

    config = generation.checkpoint_config(DEFAULT_CHECKPOINT)
    prompt_tokens, new_tokens = int(row["prompt_tokens"]), int(row["new_tokens"])
    assert 1400 <= prompt_tokens <= 1700 and 1 <= new_tokens <= max_new
    seq_len = prompt_tokens + max_new  # what caches are sized for
    cache_len = min(seq_len, math.ceil(0.25 * seq_len / 8) * 8)
    assert cache_len < prompt_tokens  # so every cache is full after prefill
    n = prompt_tokens + new_tokens - 1
    kept = cache_len * (bits / 16 if bits else 1)
    ratio = (n - kept) / n
    strategies = ["recent_global"] * 15 + ["heavy_hitter"] * 15
    per_layer = [expected_layer_bytes(s, cache_len, config.n_local_heads, config.head_dim, 2, bits) for s in strategies]

    assert float(row["compression_ratio"]) == pytest.approx(ratio, rel=1e-12)
    assert json.loads(row["compression_ratio_per_layer"]) == pytest.approx([ratio] * 30, rel=1e-12)
    assert json.loads(row["cache_memory_bytes_per_layer"]) == per_layer
    assert int(row["cache_memory_bytes"]) == sum(per_layer)
    assert f"compression ratio: {ratio:.4f}" in out
    assert f"cache memory: {sum(per_layer) / 2**20:.2f} MiB" in out


@pytest.mark.slow
def test_adaptive_head_budgets_report_allocated_and_kept_bytes_by_hand(tmp_path, capsys):
    """l2 at 25% with adaptive head budgets through generate.py: every layer allocates twice the
    uniform slots, keeps heads x budget tokens, and the two byte counts are printed apart."""
    csv_path = tmp_path / "stats.csv"
    argv = ["--prompt", "long_niah.txt", "--max_cache_length", "0.25", "--max_new_tokens", "4", "--cache_config", "l2",
            "--head_budgets", "adaptive", "--device", "cpu", "--csv", str(csv_path)]  # fmt: skip
    generate_cli.main(argv)
    out = capsys.readouterr().out
    (row,) = list(csv.DictReader(csv_path.open()))
    config = generation.checkpoint_config(DEFAULT_CHECKPOINT)
    prompt_tokens, new_tokens = int(row["prompt_tokens"]), int(row["new_tokens"])
    seq_len = prompt_tokens + 4
    budget = math.ceil(0.25 * seq_len / 8) * 8
    capacity = min(seq_len, math.ceil(2 * budget / 8) * 8)
    norms = config.n_local_heads * capacity * 4  # l2's key norms (float32)
    allocated = expected_layer_bytes("l2", capacity, config.n_local_heads, config.head_dim, 2) + norms
    n = prompt_tokens + new_tokens - 1
    assert json.loads(row["cache_memory_bytes_per_layer"]) == [allocated] * 30
    assert json.loads(row["kept_memory_bytes_per_layer"]) == [round(allocated * budget / capacity)] * 30
    assert float(row["compression_ratio"]) == pytest.approx((n - budget) / n, rel=1e-12)
    kept = 30 * round(allocated * budget / capacity)
    assert f"cache memory: {30 * allocated / 2**20:.2f} MiB allocated, {kept / 2**20:.2f} MiB of it kept" in out


def test_generate_profile_writes_a_chrome_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    generate_cli.main(["--max_new_tokens", "3", "--device", "cpu", "--profile", str(trace)])
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "generate" for e in events)
    projections = {"aten::mm", "kvwb::half_rows"}  # half_rows: half precision where the CPU emulates it
    assert any(e.get("name") in projections for e in events)  # the model's matmuls ran under it
    assert f"profile: {trace}" in capsys.readouterr().out


# -- quantized caches ------------------------------------------------------------------------------
@pytest.mark.slow
def test_8bit_cache_gives_unquantized_greedy_output(model_fp32, short_prompt_ids, tokenizer):
    reference, _ = run(model_fp32, short_prompt_ids, tokenizer, **AT_FULL_LENGTH["full"])
    quantized, stats = run(model_fp32, short_prompt_ids, tokenizer, **AT_FULL_LENGTH["full"], cache_bits=8)
    assert quantized == reference, tokenizer.decode(quantized)
    assert stats["compression_ratio"] == pytest.approx(0.5)  # every token kept, at 8 of 16 bits


@pytest.mark.slow
def test_4bit_cache_memory_counts_packed_bytes(model_bf16, short_prompt_ids, tokenizer):
    n_new = 4
    _, plain = run(model_bf16, short_prompt_ids, tokenizer, n=n_new, cache_strategy=["l2"], prompt_compression_strategy=["l2"])  # fmt: skip
    tokens, packed = run(
        model_bf16, short_prompt_ids, tokenizer, n=n_new, cache_strategy=["l2"], prompt_compression_strategy=["l2"], cache_bits=4
    )  # fmt: skip
    config = model_bf16.config
    cache_len = short_prompt_ids.numel() + n_new  # 1.0 of the sequence, capped at the sequence
    slots = config.n_local_heads * cache_len
    norms = slots * 4
    assert plain["cache_memory_bytes"] == config.n_layer * (expected_layer_bytes("l2", cache_len, config.n_local_heads, config.head_dim, 2) + norms)  # fmt: skip
    per_layer = slots * config.head_dim // 2 * 2 + 4 * slots * 2 + slots * 4 + norms  # codes, scales/zeros, pos, norms
    assert packed["cache_memory_bytes_per_layer"] == [per_layer] * config.n_layer
    n = short_prompt_ids.numel() + len(tokens) - 1  # every token that passed through is kept, at 4 of 16 bits
    assert packed["compression_ratio"] == pytest.approx((n - n * 4 / 16) / n)


# -- tiny model: compressed generation and compile ---------------------------------------------------
COMPRESSED = {
    "recent_global": dict(cache_strategy=["recent_global"]),
    "random": dict(cache_strategy=["random"], prompt_compression_strategy=["random"]),
    "l2": dict(cache_strategy=["l2"], prompt_compression_strategy=["l2"]),
    "heavy_hitter": dict(cache_strategy=["heavy_hitter"], prompt_compression_strategy=["heavy_hitter"]),
    "heavy_hitter_window4_threshold": dict(
        cache_strategy=["heavy_hitter"],
        prompt_compression_strategy=["recent_global"],
        history_window_size=4,
        attn_thresholding=True,
    ),
    "keep_it_odd": dict(cache_strategy=["keep_it_odd"], prompt_compression_strategy=["keep_it_odd"]),
    "local_global_4bit": dict(
        cache_strategy=["full", "l2"],
        prompt_compression_strategy=["full", "l2"],
        cache_strategy_pattern="repeat",
        max_cache_length=[1.0, 0.5],
        cache_length_pattern="repeat",
        cache_bits=4,
    ),
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_transformer(seed=0)


def tiny_cache_kwargs(name):
    return default_cache_kwargs(
        **{"max_cache_length": [0.5], "global_tokens": 2, "recent_window": 4, **COMPRESSED[name]}
    )


@pytest.mark.parametrize("name", COMPRESSED)
def test_tiny_model_compressed_generation(name, tiny):
    """40-token prompt + 24 new tokens into 50% caches (32 slots): full, no duplicates, protected tokens kept."""
    torch.manual_seed(0)
    tokens, stats = generation.generate(tiny, tiny_prompt(40), 24, tiny_cache_kwargs(name))
    assert len(tokens) == 24
    caches = [layer.attention.kv_cache for layer in tiny.layers]
    n = 40 + 24 - 1  # the last new token never enters the cache
    bits = 0.25 if "4bit" in name else 1.0
    assert [c.max_cache_length for c in caches] == ([64, 32] if name == "local_global_4bit" else [32, 32])
    for cache in caches:
        for head_pos in cache.pos[0].tolist():
            assert len(set(head_pos) - {-1}) == min(cache.max_cache_length, n), "filled, no position twice"
            assert {0, 1, 59, 60, 61, 62} <= set(head_pos)
    expected = [(n - min(c.max_cache_length, n) * bits) / n for c in caches]
    assert stats["compression_ratio_per_layer"] == pytest.approx(expected, rel=1e-12)


# Compiling for a new cache configuration is slow on CPU: a few strategies that cover the distinct decode
# paths (random scores, attention history + thresholding + ring, 4-bit packed storage with a full layer
# beside a head-specific one), and a bfloat16 full cache, whose tokens drift from eager's unless inductor
# rounds bfloat16 where eager does.
COMPILE_CASES = [
    ("random", torch.float32),
    ("heavy_hitter_window4_threshold", torch.float32),
    ("local_global_4bit", torch.float32),
    ("full", torch.bfloat16),
]


def test_compile_steps_leaves_the_global_inductor_configuration_alone():
    import torch._inductor.config as inductor_config

    before = inductor_config.get_config_copy()
    generation.compile_steps(generation.STEPS, torch.device("cpu"))
    assert inductor_config.get_config_copy() == before


def fresh_compile_steps(model_fns: dict) -> dict:
    """compile_steps with a fresh recompile budget."""
    torch._dynamo.reset()
    return generation.compile_steps(model_fns, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype"), COMPILE_CASES)
def test_compile_gives_eager_tokens(name, dtype, tiny):
    steps = fresh_compile_steps(generation.STEPS)
    model = tiny if dtype == torch.float32 else tiny_transformer(seed=0, dtype=dtype)
    kwargs = tiny_cache_kwargs(name) if name in COMPRESSED else default_cache_kwargs(max_cache_length=[1.0])
    prompt = tiny_prompt(40, seed=1)
    torch.manual_seed(0)
    eager, eager_stats = generation.generate(model, prompt, 32, kwargs)
    eager_pos = [layer.attention.kv_cache.pos.clone() for layer in model.layers]
    torch.manual_seed(0)
    compiled, compiled_stats = generation.generate(model, prompt, 32, kwargs, steps=steps)
    assert compiled.tolist() == eager.tolist()
    for layer, pos in zip(model.layers, eager_pos):
        assert torch.equal(layer.attention.kv_cache.pos, pos), "compiled and eager caches evicted differently"
    assert compiled_stats["compression_ratio"] == eager_stats["compression_ratio"]
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_prefill_normalizes_and_projects_a_bfloat16_prompt_exactly_as_eager():
    """At the embedded model's sizes, where the tiny model's are too small to show it. With frozen
    weights, a bfloat16 prompt projected in float32 (CPUs without bf16 instructions) may go through a
    prepacked GEMM that rounds unlike eager's, and a fused RMSNorm may sum float32 squares in its own
    order. Either changes greedy tokens."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(49152, 576).to(torch.bfloat16).requires_grad_(False)
    norm = RMSNorm(576).to(torch.bfloat16).requires_grad_(False)
    layer = cpu_backend.apply(torch.nn.Linear(576, 1536, bias=False).to(torch.bfloat16).requires_grad_(False))
    assert isinstance(layer, CPULinear)
    ids = torch.randint(0, 49152, (1, 4096))
    steps = fresh_compile_steps({"prefill": lambda m, x: m(x), "decode": lambda m, x: m(x)})
    x = embedding(ids)
    assert torch.equal(steps["prefill"](norm, x), norm(x))
    assert torch.equal(steps["prefill"](layer, x[:, :512]), layer(x[:, :512]))
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("cache_args", [{}, {"cache_bits": 4}], ids=["full", "full-4bit"])
@torch.no_grad()  # as generation runs it: inductor freezes weights only without autograd
def test_compiled_decode_gives_eager_bfloat16_logits_on_the_embedded_model(cache_args, model_bf16, short_prompt_ids):
    """Bit for bit, where the tiny model is too small to show a difference: an autotuned micro-GEMM
    (max-autotune) would sum the one-token projections in another order than eager's torch.mv, and
    inductor's own softmax and its reduction for the 4-bit cache's zero-point term in other orders
    than eager's kernels; each would make bfloat16 greedy tokens drift. Where the CPU has bfloat16
    instructions, load_model packs the projections for oneDNN, and inductor must not fuse the following
    SiLU or residual add into that product (rounding once, where eager rounds twice)."""
    packed = packed_copies(model_bf16)
    assert all(packed) == any(packed) and (ONEDNN_PACKS_BFLOAT16 or not any(packed))  # all or none (free memory)
    compiled_steps = fresh_compile_steps(generation.STEPS)
    kwargs = default_cache_kwargs(**cache_args)
    logits = {}
    for name, decode in (("eager", generation.decode_one_token), ("compiled", compiled_steps["decode"])):
        steps = {"prefill": generation.prefill, "decode": decode}
        last, _, _ = generation.prefill_prompt(model_bf16, short_prompt_ids, 8, kwargs, steps)
        logits[name] = [last]
        for i in range(8):
            pos = torch.tensor([short_prompt_ids.numel() + i])
            logits[name].append(decode(model_bf16, logits["eager"][i].argmax().view(1, 1), pos))
    for step, (eager, compiled) in enumerate(zip(logits["eager"], logits["compiled"], strict=True)):
        assert torch.equal(compiled, eager), f"decode step {step}"
    torch._dynamo.reset()
