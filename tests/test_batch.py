"""Batches: every prompt of a batch of different lengths gives the tokens and cache statistics it
gives alone, for every registered strategy (and its debug_ twin) on the tiny model; a sequence that
ends early stops without holding the others back."""

import csv
import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import tiny_prompt, tiny_transformer
from test_registry import names_and_some_debug

import cpu_backend
import generation
import strategies
from cache_args import check_compatibility, default_cache_kwargs
from cpu_backend import HALF_MATMUL_IS_EMULATED
from generate import PROMPT_DIR
from generation import DEFAULT_CHECKPOINT, load_model
from tokenizer import get_tokenizer

ROOT = PROMPT_DIR.parent

LENGTHS = (37, 12, 50, 5, 29, 44, 20, 33)
NEW_TOKENS = 12
SAME_STATISTICS = ("prompt_tokens", "new_tokens", "compression_ratio", "cache_memory_bytes", "kept_memory_bytes")


@pytest.fixture(scope="module")
def tiny():
    return tiny_transformer(seed=0)


def compressing_kwargs(name: str, **overrides) -> dict:
    """A quarter of each sequence (at least 8 slots) with the strategy's natural compressor."""
    kwargs = default_cache_kwargs(
        cache_strategy=[name],
        prompt_compression_strategy=[strategies.natural_compressor(name)],
        max_cache_length=[1.0 if strategies.strategy_class(name).spans_sequence else 0.25],
        **overrides,
    )
    check_compatibility(kwargs, 2)
    return kwargs


def alone_and_batched(model, kwargs: dict, prompts: list, terminators=(), context_lengths=None, steps=None):
    seeds = list(range(len(prompts)))
    context_lengths = context_lengths or [None] * len(prompts)
    alone = []
    for prompt, seed, context_length in zip(prompts, seeds, context_lengths):
        torch.manual_seed(seed)
        alone.append(
            generation.generate(
                model, prompt, NEW_TOKENS, kwargs, terminators, steps=steps, context_length=context_length
            )
        )
    batched = generation.generate_batch(
        model, prompts, NEW_TOKENS, kwargs, terminators, steps=steps, context_lengths=context_lengths, seeds=seeds
    )
    return alone, batched


def assert_same(alone, batched) -> None:
    for (tokens, stats), (batch_tokens, batch_stats) in zip(alone, batched, strict=True):
        assert batch_tokens.tolist() == tokens.tolist()
        for key in SAME_STATISTICS:
            assert batch_stats.get(key) == stats.get(key), key


@pytest.mark.parametrize("name", names_and_some_debug())
def test_each_prompt_of_a_batch_decodes_as_it_does_alone(name, tiny):
    prompts = [tiny_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    alone, batched = alone_and_batched(tiny, compressing_kwargs(name), prompts)
    assert_same(alone, batched)
    if not strategies.strategy_class(name).spans_sequence:
        assert max(s["compression_ratio"] for _, s in alone) > 0.5  # the rows did compress


@pytest.mark.skipif(not HALF_MATMUL_IS_EMULATED, reason="the half kernels serve CPUs that emulate half precision")
@pytest.mark.parametrize("name", strategies.strategy_names())
def test_a_bfloat16_batch_decodes_as_alone_through_the_half_kernels(name):
    """Where half precision is emulated, a decode step's projections and attention (half_kernels.cpp
    where built) do not depend on the other sequences of the batch, nor on the batch cache's slots past
    a sequence's own."""
    model = cpu_backend.apply(tiny_transformer(seed=0, dtype=torch.bfloat16))
    prompts = [tiny_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    assert_same(*alone_and_batched(model, compressing_kwargs(name), prompts))


def test_a_sequence_that_ends_stops_alone_while_the_others_run(tiny):
    kwargs = compressing_kwargs("l2")
    prompts = [tiny_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    first_run = generation.generate(tiny, prompts[0], NEW_TOKENS, kwargs)[0].tolist()
    terminator = first_run[3]
    alone, batched = alone_and_batched(tiny, kwargs, prompts, terminators=[terminator])
    assert_same(alone, batched)
    assert len(batched[0][0]) <= 4 < max(len(t) for t, _ in batched)


def test_each_prompt_of_a_batch_samples_as_it_does_alone(tiny):
    """Sampling (temperature 0.8, top-k 20): each prompt draws from its own seeded generator, so it
    samples the tokens it samples alone, whatever else is in the batch."""
    prompts = [tiny_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    kwargs, sampling = compressing_kwargs("l2"), {"temperature": 0.8, "top_k": 20}
    alone = [
        generation.generate_batch(tiny, [p], NEW_TOKENS, kwargs, seeds=[i], **sampling)[0]
        for i, p in enumerate(prompts)
    ]
    batched = generation.generate_batch(tiny, prompts, NEW_TOKENS, kwargs, seeds=range(len(prompts)), **sampling)
    assert_same(alone, batched)
    greedy = generation.generate_batch(tiny, prompts, NEW_TOKENS, kwargs, seeds=range(len(prompts)))
    assert [t.tolist() for t, _ in greedy] != [t.tolist() for t, _ in batched]  # it did sample


@pytest.mark.parametrize("name", ["l2", "heavy_hitter", "kvzip"])
def test_context_only_and_chunked_prefill_batch_as_alone(name, tiny):
    """Each row compresses its context before its question, in chunks, on its own."""
    kwargs = compressing_kwargs(name, context_only=True, prefill_chunk_size=16)
    prompts = [tiny_prompt(n + 6, seed=i) for i, n in enumerate(LENGTHS)]
    alone, batched = alone_and_batched(tiny, kwargs, prompts, context_lengths=list(LENGTHS))
    assert_same(alone, batched)


def test_adaptive_head_budgets_batch_as_alone(tiny):
    kwargs = compressing_kwargs("l2", head_budgets="adaptive")
    prompts = [tiny_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    assert_same(*alone_and_batched(tiny, kwargs, prompts))


def test_heavy_hitter_history_ring_batches_as_alone(tiny):
    kwargs = compressing_kwargs("heavy_hitter", history_window_size=3)
    prompts = [tiny_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    assert_same(*alone_and_batched(tiny, kwargs, prompts))


def test_heavy_hitter_top_fraction_counts_a_rows_own_slots(tiny):
    """A short prompt's row keeps the top half of its own slots' attention, not of the batch's
    padded row: its recorded scores are those it records alone."""
    kwargs = compressing_kwargs("heavy_hitter", attn_top_k=0.5)
    short, long = tiny_prompt(5, seed=0), tiny_prompt(50, seed=1)
    generation.generate(tiny, short, NEW_TOKENS, kwargs)
    alone = [layer.attention.kv_cache.attn_history.clone() for layer in tiny.layers]
    generation.generate_batch(tiny, [short, long], NEW_TOKENS, kwargs)
    for layer, history in zip(tiny.layers, alone):
        batched = layer.attention.kv_cache.attn_history
        assert batched.shape[2] > history.shape[2]
        torch.testing.assert_close(batched[:1, :, : history.shape[2]], history)  # sums in another order


@pytest.mark.slow
def test_compiled_batch_decodes_as_alone(tiny):
    """Compiled decode steps (prefill stays eager: it runs alone either way)."""
    steps = {**generation.STEPS, "decode": generation.compile_steps(generation.STEPS, torch.device("cpu"))["decode"]}
    prompts = [tiny_prompt(n, seed=i) for i, n in enumerate(LENGTHS[:4])]
    assert_same(*alone_and_batched(tiny, compressing_kwargs("heavy_hitter"), prompts, steps=steps))


@pytest.mark.slow
def test_compiled_bfloat16_batch_decodes_as_eager():
    """A bfloat16 batch multiplies its rows in half_kernels.cpp where half precision is emulated (a custom
    op that inductor calls); compiled steps round as eager ones do."""
    model = cpu_backend.apply(tiny_transformer(seed=0, dtype=torch.bfloat16))
    steps = {**generation.STEPS, "decode": generation.compile_steps(generation.STEPS, torch.device("cpu"))["decode"]}
    prompts = [tiny_prompt(n, seed=i) for i, n in enumerate(LENGTHS[:4])]
    kwargs = compressing_kwargs("l2")
    eager = generation.generate_batch(model, prompts, NEW_TOKENS, kwargs, seeds=range(4))
    compiled = generation.generate_batch(model, prompts, NEW_TOKENS, kwargs, steps=steps, seeds=range(4))
    assert [tokens.tolist() for tokens, _ in compiled] == [tokens.tolist() for tokens, _ in eager]


@pytest.fixture(scope="module")
def embedded():
    return load_model(DEFAULT_CHECKPOINT, "cpu", torch.float32), get_tokenizer(DEFAULT_CHECKPOINT)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["heavy_hitter"])
def test_embedded_model_batch_decodes_as_alone(name, embedded):
    """SmolLM2 in float32, greedy, 8 chat prompts of 30 to 430 tokens, 25% budgets: at the real
    model's sizes, for one strategy (the tiny model's batch tests take every one)."""
    model, tokenizer = embedded
    words = (PROMPT_DIR / "long_niah.txt").read_text().split()
    prompts = [
        torch.tensor(
            tokenizer.encode(tokenizer.apply_chat_template(" ".join(words[-n:]) + "\nWhat is the magic number?"))
        )
        for n in (300, 15, 120, 40, 220, 80, 5, 160)
    ]
    assert len({p.numel() for p in prompts}) == 8
    kwargs = default_cache_kwargs(
        cache_strategy=[name], prompt_compression_strategy=[strategies.natural_compressor(name)],
        max_cache_length=[1.0 if name == "full" else 0.25],
    )  # fmt: skip
    alone, batched = alone_and_batched(model, kwargs, prompts, terminators=tokenizer.terminator_ids)
    assert_same(alone, batched)


def run_generate(*argv) -> str:
    done = subprocess.run([sys.executable, "generate.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_generate_py_runs_a_prompts_file_in_batches(tmp_path):
    """A JSONL prompts file of 5 through `generate.py --batch_size 4` (a full batch, then one prompt)
    prints each output as `--batch_size 1` does, the batch's throughput, and a csv row per prompt,
    under the header of a file that already holds a single prompt's row."""
    texts = ["What is a cold compress?", "Hi", "Name three colors.", "Why is the sky blue?", "Tell me about the sea."]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    flags = ["--prompts_file", str(prompts), "--max_new_tokens", "8", "--dtype", "float32", "--cache_strategy", "l2"]
    flags += ["--max_cache_length", "0.5", "--prompt_compression_strategy", "l2"]
    outputs, rows = {}, {}
    single_csv = tmp_path / "batch4.csv"
    run_generate("--prompt", "Hi", "--max_new_tokens", "2", "--csv", str(single_csv))
    with single_csv.open() as f:
        single = list(csv.DictReader(f))
    for batch_size in (1, 4):
        csv_path = tmp_path / f"batch{batch_size}.csv"
        out = run_generate(*flags, "--batch_size", str(batch_size), "--csv", str(csv_path))
        outputs[batch_size] = re.findall(r"--- prompt (\d) of 5 ---\n(.*?)\n\nprefill: (\d+) tokens", out, re.S)
        assert f"5 prompts in batches of {batch_size}: prefill" in out and "tokens/s over the batch" in out
        with csv_path.open() as f:
            rows[batch_size] = list(csv.DictReader(f))
    assert rows[4][0] == {**single[0], "prompt_index": None}  # the earlier line as it was, under the wider header
    rows[4] = rows[4][1:]
    assert [n for n, _, _ in outputs[4]] == ["1", "2", "3", "4", "5"]
    assert outputs[4] == outputs[1] and all(text.strip() for _, text, _ in outputs[4])
    assert [r["prompt_index"] for r in rows[4]] == ["1", "2", "3", "4", "5"]
    assert [r["batch_size"] for r in rows[4]] == ["4"] * 5
    for key in ("prompt_tokens", "new_tokens", "compression_ratio", "cache_memory_bytes"):
        assert [r[key] for r in rows[4]] == [r[key] for r in rows[1]], key
    assert len({r["prompt_tokens"] for r in rows[4]}) > 1


@pytest.mark.slow
def test_generate_py_samples_each_prompt_alike_in_any_batch(tmp_path):
    """`--temperature 0.9 --top_k 40` over a prompts file: each prompt's sampled text is the same with
    `--batch_size 1` and `--batch_size 3`; another `--seed` samples other text."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me a story.\nName an animal.\nWhat is rain?\n")
    flags = ["--prompts_file", str(prompts), "--max_new_tokens", "12", "--dtype", "float32"]
    flags += ["--temperature", "0.9", "--top_k", "40"]
    outputs = {}
    for batch_size, seed in ((1, "0"), (3, "0"), (3, "1")):
        out = run_generate(*flags, "--batch_size", str(batch_size), "--seed", seed)
        outputs[batch_size, seed] = re.findall(r"--- prompt \d of 3 ---\n(.*?)\n\nprefill:", out, re.S)
    assert len(outputs[3, "0"]) == 3 and outputs[3, "0"] == outputs[1, "0"]
    assert outputs[3, "1"] != outputs[3, "0"]
