"""benchmark.py and its plan (benchmark_plan.py, cache_configs/benchmark/plan.yaml) and report
(benchmark_report.py): the grid plan and the targets arithmetic (fast), and a smoke run of the
command on the embedded model (slow).

Speed itself is never asserted here: the targets are ratios printed by one benchmark run.
"""

import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_prompt, tiny_transformer

import benchmark
import benchmark_plan
import benchmark_report
import generation
import strategies
from benchmark_plan import PLAN, QUICK, Config, compute_targets, plan_configs
from benchmark_report import COLUMNS

ROOT = Path(benchmark.__file__).resolve().parent
CONTEXTS = dict(short=512, long=4096, memory=8192, memory_small=1024)


def parsed(*argv: str):
    args = benchmark.build_parser().parse_args(list(argv))
    benchmark.resolve_options(args)
    return args


def test_default_plan_covers_every_target():
    args = parsed()
    configs = set(plan_configs(args))
    assert args.compare == "hf" and args.bound and args.target_contexts == [512, 4096, 8192, 1024] and args.rounds == 2
    for ctx in (512, 4096):
        for dtype in ("bfloat16", "float32"):
            for mode in ("eager", "compiled"):
                assert Config("ours", "full", 1.0, ctx, dtype, mode, None) in configs
    for strategy in ("recent_global", "l2", "heavy_hitter"):
        assert Config("ours", strategy, 0.1, 4096, "bfloat16", "eager", None) in configs
    assert Config("ours", "heavy_hitter", 0.1, 8192, "bfloat16", "eager", None) in configs
    assert Config("ours", "full", 1.0, 8192, "bfloat16", "eager", None) in configs
    assert Config("ours", "full", 1.0, 4096, "bfloat16", "eager", 4) in configs
    for ctx in (1024, 8192):
        for chunk in (512, None):
            assert Config("ours", "l2", 512, ctx, "bfloat16", "eager", None, chunk) in configs
    assert Config("ours", "l2", 0.25, 4096, "bfloat16", "eager", None, questions=8) in configs


def test_grid_is_a_cartesian_product_and_full_ignores_budgets():
    args = parsed(
        "--strategies", "full", "l2", "--budgets", "1.0", "0.1", "0.2",
        "--context_lengths", "64", "--dtypes", "float32", "--modes", "eager", "compiled", "--cache_bits", "none", "4",
    )  # fmt: skip
    configs = plan_configs(args)
    assert args.compare == "none" and not args.bound and args.rounds == 1
    full = [c for c in configs if c.strategy == "full"]
    l2 = [c for c in configs if c.strategy == "l2"]
    assert len(full) == 2 * 2 and all(c.budget == 1.0 for c in full)  # modes x bits, once each
    assert sorted({c.budget for c in l2}) == [0.1, 0.2] and len(l2) == 2 * 2 * 2
    assert {c.compressor for c in l2} == {"l2"}
    assert Config("ours", "recent_global", 0.1, 1, "float32", "eager", None).compressor == "recent_global"
    assert Config("ours", "heavy_hitter", 0.1, 1, "float32", "eager", None).compressor == "heavy_hitter"


def test_grid_flags_filter_the_target_plan():
    args = parsed("--plan", "targets", "--modes", "eager", "--dtypes", "bfloat16", "--budgets", "0.1")
    configs = plan_configs(args)
    assert args.compare == "hf" and args.bound
    assert {c.mode for c in configs} == {"eager"} and {c.dtype for c in configs} == {"bfloat16"}
    assert Config("ours", "full", 1.0, 512, "bfloat16", "eager", None) in configs  # full has no budget to filter
    assert Config("ours", "heavy_hitter", 0.1, 8192, "bfloat16", "eager", None) in configs
    assert len(configs) == 2 + 3 + 2 + 1


def test_quick_preset_and_explicit_flags():
    args = parsed("--quick", "--strategies", "full", "--context_lengths", "48")
    configs = plan_configs(args)
    assert configs == [Config("ours", "full", 1.0, 48, "float32", "eager", None)]
    assert args.target_contexts == [48, 48, 48, 48] and args.decode_steps == QUICK["decode_steps"]
    assert not args.bound and args.compare == "none" and args.rounds == 1


def test_every_target_of_the_plan_has_rows_in_the_default_plan():
    """Rows for every configuration of the default plan (and HF rows at its contexts) give each
    target of the plan file at least one line."""
    configs = plan_configs(parsed())
    hf = {(c.context, c.dtype) for c in configs}
    rows = [row(**{**vars(c), "compressor": c.compressor}) for c in configs]
    rows += [row(impl="hf", strategy="dynamic", context=ctx, dtype=dtype) for ctx, dtype in hf]
    for r in rows:
        r.update(frac_of_bound=0.5, paired_speedup=1.5 if r["mode"] == "compiled" else None)
        if r["questions"]:
            r.update(shared_over_separate=0.3, same_answers=1)
        r["tokens_sha"] = "b" if r["mode"] == "compiled" and r["dtype"] != "float32" else "a"  # a follow-up line too
    lines = compute_targets(rows, CONTEXTS)
    for spec in PLAN["performance"]["targets"]:
        prefix = spec["what"].split("{")[0]
        assert any(t["target"] == str(spec["id"]) and t["what"].startswith(prefix) for t in lines), spec["what"]


def test_the_plan_file_names_registered_strategies_and_the_code_names_none():
    named = {s for g in PLAN["performance"]["rows"] for s in g["strategies"]} | set(QUICK["strategies"])
    for spec in PLAN["performance"]["targets"]:
        for wanted in (spec["rows"], spec.get("against", {})):
            value = wanted.get("strategy", [])
            named |= set(value if isinstance(value, list) else [value])
    assert named and named <= set(strategies.STRATEGIES)
    for module in (benchmark, benchmark_plan, benchmark_report):
        source = Path(module.__file__).read_text()
        assert not [name for name in strategies.STRATEGIES if f'"{name}"' in source], module.__name__


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(at_most=1.0), "exactly one of at_least, at_most"),
        (dict(typo=1), "unknown keys typo"),
        (dict(value="decode_tok_s"), "exactly one of ratio, value, equal"),
        (dict(judge="sometimes"), "judge must be one of"),
        (dict(rows=dict(context="medium")), "context 'medium'"),
        (dict(after_failed="nothing"), "names no earlier target"),
    ],
)
def test_a_mistake_in_the_plan_file_is_reported_with_its_target(change, message):
    spec = dict(id=9, what="x", rows={}, against={}, ratio="decode_tok_s", at_least=1.0)
    with pytest.raises(ValueError, match=message):
        benchmark_plan.check_target({**spec, **change}, CONTEXTS, set())


def test_an_empty_grid_stops_before_measuring(capsys):
    with pytest.raises(SystemExit, match="the grid is empty"):
        benchmark.main(["--strategies", "l2", "--budgets", "1.0", "--device", "cpu"])


def row(**kw) -> dict:
    base = {k: None for k in COLUMNS}
    base.update(impl="ours", strategy="full", budget=1.0, context=512, dtype="bfloat16", mode="eager", error="")
    base.update(questions=0, batch=1)
    base.update(decode_tok_s=10.0, prefill_tok_s=100.0, prefill_peak_mib=100.0, cache_mib=10.0, tokens_sha="a")
    base.update(kw)
    return base


def test_rounds_run_round_robin_and_keep_each_rows_fastest_prefill_and_decode():
    full, l2 = (
        Config("ours", "full", 1.0, 64, "float32", "eager", None),
        Config("ours", "l2", 0.1, 64, "float32", "eager", None),
    )
    speeds = {(full, 0): (10.0, 100.0), (l2, 0): (14.0, 90.0), (full, 1): (12.0, 80.0), (l2, 1): (13.0, 95.0)}
    order = []

    def measure_one(cfg, round_index):
        order.append((cfg.strategy, round_index))
        decode, prefill = speeds[cfg, round_index]
        return row(
            strategy=cfg.strategy,
            decode_tok_s=decode,
            prefill_tok_s=prefill,
            prefill_s=64 / prefill,
            peak_mem_mib=decode,
            prefill_peak_mib=prefill,
        )

    rows = benchmark.in_rounds([full, l2], 2, measure_one)
    assert order == [("full", 0), ("l2", 0), ("full", 1), ("l2", 1)]
    assert [(r["strategy"], r["decode_tok_s"], r["prefill_tok_s"], r["rounds"]) for r in rows] == [
        ("full", 12.0, 100.0, 2),
        ("l2", 14.0, 95.0, 2),
    ]
    assert rows[0]["peak_mem_mib"] == 12.0 and rows[0]["prefill_s"] == pytest.approx(0.64)  # decode round's memory
    assert rows[0]["prefill_peak_mib"] == 80.0 and rows[1]["prefill_peak_mib"] == 90.0  # the smallest prefill peak
    failed, ok = row(error="RuntimeError: boom", decode_tok_s=None), row(decode_tok_s=3.0)
    assert benchmark.fastest([failed, ok])["decode_tok_s"] == 3.0 and benchmark.fastest([failed]) is failed
    assert benchmark.fastest([ok, row(tokens_sha="b")])["error"] == "greedy tokens differ between rounds"


def by_what(targets) -> dict:
    return {t["what"]: t for t in targets}


def test_targets_are_ratios_of_this_runs_rows():
    rows = [
        row(impl="hf", strategy="dynamic", decode_tok_s=4.0, prefill_tok_s=50.0),
        row(decode_tok_s=12.0, frac_of_bound=0.7),
        row(mode="compiled", decode_tok_s=20.0, tokens_sha="b"),
        row(context=4096, decode_tok_s=8.0, prefill_tok_s=60.0),
        row(impl="hf", strategy="dynamic", context=4096, decode_tok_s=5.0, prefill_tok_s=50.0),
        row(strategy="heavy_hitter", budget=0.1, context=4096, decode_tok_s=9.0, prefill_tok_s=30.0),
        row(strategy="l2", budget=0.1, context=4096, decode_tok_s=12.0),
        row(context=4096, cache_bits=4, cache_mib=2.5, decode_tok_s=6.0),
        row(context=8192, prefill_peak_mib=200.0),
        row(strategy="heavy_hitter", budget=0.1, context=8192, prefill_peak_mib=300.0),
        row(strategy="recent_global", budget=0.1, context=4096, error="RuntimeError: boom"),
        row(dtype="float32", tokens_sha="b"),
    ]
    targets = by_what(compute_targets(rows, CONTEXTS))
    # against HF and the bound, a compiled row is judged and the eager one beside it is information
    t = targets["decode full @512 bfloat16 eager: ours/HF"]
    assert t["value"] == pytest.approx(3.0) and t["passed"] is None
    t = targets["decode full @512 bfloat16 compiled: ours/HF"]
    assert t["value"] == pytest.approx(5.0) and t["passed"] is True
    assert targets["decode full @512 bfloat16 eager: fraction of bound"]["passed"] is None
    assert not targets["decode full @4096 bfloat16 eager: ours/HF"]["passed"]  # 1.6 < 2
    assert not targets["decode heavy_hitter 10% @4096 bfloat16 eager: / full"]["passed"]  # 1.125
    assert targets["decode l2 10% @4096 bfloat16 eager: / full"]["value"] == pytest.approx(1.5)
    assert not any("recent_global" in w for w in targets)  # failed rows are ignored
    assert targets["prefill full @4096 bfloat16 eager: ours/HF"]["value"] == pytest.approx(1.2)
    assert not targets["prefill heavy_hitter 0.1 @4096 bfloat16 eager: / full"]["passed"]  # 0.5
    assert not targets["prefill peak memory heavy_hitter 0.1 @8192 bfloat16 eager: / full"]["passed"]  # 1.5
    assert targets["cache memory 4-bit (bfloat16) / bfloat16, full @4096 eager"]["value"] == pytest.approx(0.25)
    assert targets["decode 4-bit / unquantized, full @4096 bfloat16 eager"]["value"] == pytest.approx(0.75)
    compiled = targets["decode compiled / eager rows, full 1 @512 bfloat16"]
    assert compiled["value"] == pytest.approx(20 / 12) and compiled["passed"]
    # a compiled row with steps alternated against eager is judged by that ratio; the rows' ratio is information
    alternated = by_what(compute_targets([*rows, row(context=4096, mode="compiled", paired_speedup=1.2)], CONTEXTS))
    assert alternated["decode compiled / eager, steps alternated, full 1 @4096 bfloat16"]["passed"] is False
    assert alternated["decode compiled / eager rows, full 1 @4096 bfloat16"]["passed"] is None
    assert not targets["greedy tokens compiled == eager, full 1 @512 bfloat16"]["passed"]
    # the compiled bfloat16 tokens equal float32's: shown as information (rounding order, not a bug)
    assert targets["greedy tokens compiled full 1 @512 bfloat16 == eager float32"]["passed"] is None
    text = benchmark_report.format_targets(list(targets.values()))
    assert "[PASS]" in text and "[FAIL]" in text and "[info]" in text
    judged = [t for t in targets.values() if t["passed"] is not None]
    assert f"{sum(t['passed'] for t in judged)}/{len(judged)} passed" in text


def test_chunked_prefill_and_question_targets():
    chunked = dict(strategy="l2", budget=512.0)
    rows = [
        row(**chunked, context=1024, chunk=512, prefill_peak_mib=40.0),
        row(**chunked, context=8192, chunk=512, prefill_peak_mib=46.0, prefill_tok_s=70.0),
        row(**chunked, context=1024, prefill_peak_mib=50.0),
        row(**chunked, context=8192, prefill_peak_mib=400.0, prefill_tok_s=100.0),
        row(strategy="l2", budget=0.25, context=4096, questions=8, shared_over_separate=0.3, same_answers=0),
    ]
    targets = by_what(compute_targets(rows, CONTEXTS))
    bounded = targets["prefill peak memory l2 512 chunk 512 @8192 / @1024 bfloat16 eager"]
    assert bounded["value"] == pytest.approx(46 / 40) and bounded["passed"]
    grows = targets["prefill peak memory l2 512 one pass @8192 / @1024 bfloat16 eager"]
    assert grows["value"] == pytest.approx(8.0) and grows["passed"] is None
    assert targets["prefill speed l2 512 chunk 512 / one pass @8192 bfloat16 eager"]["value"] == pytest.approx(0.7)
    shared = targets["8 questions, one compressed context / a prefill each, l2 0.25 @4096 bfloat16 eager"]
    assert shared["passed"] and shared["value"] == pytest.approx(0.3)
    assert (
        targets["8 questions, one compressed context: the same answers as a prefill each (1 = yes)"]["passed"] is False
    )


def test_batch_targets_judge_steps_alternated_with_the_first_sequence_alone():
    batch = dict(mode="compiled", decode_tok_s=35.0, cache_mib=12.0)
    rows = [row(mode="compiled", cache_mib=12.0), row(**batch, batch=8, paired_batch_speedup=4.2)]
    rows.append(row(**batch, batch=2, paired_batch_speedup=1.3))  # at most 2x: information, not a failure
    targets = by_what(compute_targets(rows, CONTEXTS))
    alternated = targets[
        "decode full @512 bfloat16 compiled, batch 8 / alone, steps alternated (tokens/s over the batch)"
    ]
    assert alternated["value"] == pytest.approx(4.2) and alternated["passed"] is True
    pair = targets["decode full @512 bfloat16 compiled, batch 2 / alone, steps alternated (tokens/s over the batch)"]
    assert pair["value"] == pytest.approx(1.3) and pair["passed"] is None
    # a target whose text does not name the batch says it for batch rows, so no two lines read alike
    pressed = dict(strategy="heavy_hitter", budget=0.25, context=4096, prefill_tok_s=80.0)
    rows += [row(context=4096), row(**pressed), row(context=4096, batch=2), row(**pressed, batch=2)]
    lines = [t["what"] for t in compute_targets(rows, CONTEXTS)]
    assert "prefill heavy_hitter 0.25 @4096 bfloat16 eager: / full (batch 2)" in lines
    assert len(lines) == len(set(lines))
    apart = targets["decode full @512 bfloat16 compiled, batch 8 / batch 1 rows (tokens/s over the batch)"]
    assert apart["value"] == pytest.approx(3.5) and apart["passed"] is None
    assert targets["cache memory per sequence full @512 bfloat16 compiled, batch 8 == batch 1"]["passed"]
    # a batch row without the alternated steps (a failed measurement) is judged on the rows' ratio
    rows[1].update(paired_batch_speedup=None, cache_mib=13.0)
    targets = by_what(compute_targets(rows, CONTEXTS))
    assert (
        targets["decode full @512 bfloat16 compiled, batch 8 / batch 1 rows (tokens/s over the batch)"]["passed"]
        is False
    )
    assert targets["cache memory per sequence full @512 bfloat16 compiled, batch 8 != batch 1"]["passed"] is False


@pytest.mark.parametrize("strategy", ["full", "l2"])
def test_a_batchs_first_sequence_steps_on_alone_from_where_the_batch_took_it(strategy, monkeypatch):
    """The alone steps run on their own copy of the sequence's row, at the batch's positions: in
    float32 they pick the tokens the batch picks for that row, and the batch's row is left alone."""
    model = tiny_transformer(seed=0)
    calls = []

    def recorded_decode(model, x, input_pos):
        logits = generation.decode_one_token(model, x, input_pos)
        calls.append((x.shape[0], input_pos.view(-1)[0].item(), generation.sample(logits).view(-1)[0].item()))
        return logits

    monkeypatch.setitem(benchmark.STEPS, "decode", recorded_decode)
    args = parsed("--decode_steps", "4", "--warmup", "2")
    budget = 1.0 if strategy == "full" else 0.5
    cfg = Config("ours", strategy, budget, 24, "float32", "eager", None, batch=3)
    measured = benchmark.run_ours(model, cfg, tiny_prompt(24), args, torch.device("cpu"), None, None, True)
    assert measured["paired_batch_speedup"] > 0
    alone = [(pos, token) for size, pos, token in calls if size == 1 and pos >= 24]  # not a prefill's last token
    batch = [(pos, token) for size, pos, token in calls if size == 3]
    assert len(alone) == 2 + 4 and [pos for pos, _ in alone] == list(range(alone[0][0], alone[0][0] + 6))
    beside = batch[-4:]  # the batch's steps alternated with the alone ones, from the same position
    assert beside == alone[:4] and alone[0][0] > batch[-5][0]  # after the batch's earlier steps


def test_alternated_medians_calls_the_two_in_turn_and_returns_each_ones_median():
    calls = []

    def slow(seconds):
        def call(i):
            calls.append((seconds, i))
            time.sleep(seconds)

        return call

    first_s, second_s = benchmark.alternated_medians(slow(0.002), slow(0.02), 3, torch.device("cpu"))
    assert calls == [(0.002, 0), (0.02, 0), (0.002, 1), (0.02, 1), (0.002, 2), (0.02, 2)]
    assert 0.002 <= first_s < 0.02 <= second_s


def test_table_and_csv(tmp_path):
    rows = [row(prefill_s=1.0, compile_s=None), row(strategy="l2", budget=0.1, error="ValueError: x")]
    table = benchmark_report.format_table(rows)
    assert "decode tok/s" in table and "error" in table.splitlines()[-1]
    assert benchmark_report.format_table(rows, markdown=True).startswith("| impl |")
    path = tmp_path / "out.csv"
    benchmark_report.write_csv(path, rows)
    with path.open() as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == COLUMNS and read[1]["error"] == "ValueError: x"


def test_help_describes_the_presets_from_the_plan_file():
    cmd = [sys.executable, str(ROOT / "benchmark.py"), "--plan", "targets", "--help"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    text = " ".join(result.stdout.split())
    assert "cache_configs/benchmark/plan.yaml" in text and "--target_contexts SHORT LONG MEMORY MEMORY_SMALL" in text
    assert f"smoke preset: {' + '.join(QUICK['strategies'])}" in text


@pytest.mark.slow
def test_quick_run_writes_a_csv_of_positive_measurements(smollm2_checkpoint, tmp_path):
    out, trace = tmp_path / "bench.csv", tmp_path / "trace.json"
    cmd = [
        sys.executable, str(ROOT / "benchmark.py"), "--quick", "--strategies", "full", "recent_global",
        "--context_lengths", "48", "--decode_steps", "3", "--warmup", "1", "--rounds", "2", "--device", "cpu",
        "--checkpoint_path", str(smollm2_checkpoint), "--csv", str(out), "--profile", str(trace), "--profile_steps", "1",
        "--bound", "--bound_mib", "16",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out_lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["impl", "strategy", "budget"] for line in out_lines)  # the table
    assert "performance targets (ratios within this run):" in out_lines
    # a quick run's targets all refer to its one context: here the fraction of the bound
    assert any(line.startswith(("  [PASS] 1. decode full @48 float32 eager: fraction of bound", "  [FAIL] 1. decode full @48 float32 eager: fraction of bound")) for line in out_lines)  # fmt: skip
    assert any(line.endswith("passed") for line in out_lines)
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == COLUMNS
    assert [(r["strategy"], r["budget"], r["context"]) for r in rows] == [("full", "1.0", "48"), ("recent_global", "0.25", "48")]  # fmt: skip
    for r in rows:
        assert r["error"] == ""
        measured = ("prefill_tok_s", "decode_tok_s", "decode_ms", "prefill_peak_mib", "peak_mem_mib", "cache_mib")
        for column in (*measured, "bandwidth_gbs", "bound_tok_s", "frac_of_bound"):
            value = float(r[column])
            assert math.isfinite(value) and value > 0, (column, r[column])
        assert int(r["decode_steps"]) == 3 and int(r["rounds"]) == 2
    full, compressed = rows
    assert float(compressed["cache_mib"]) < float(full["cache_mib"])
    assert 0 < float(compressed["compression_ratio"]) < 1
    traces = list(tmp_path.glob("trace.*.json"))
    assert len(traces) == 2 and "traceEvents" in json.loads(traces[0].read_text())


@pytest.mark.slow
def test_chunked_prefill_and_question_rows(smollm2_checkpoint, tmp_path):
    out = tmp_path / "bench.csv"
    cmd = [
        sys.executable, str(ROOT / "benchmark.py"), "--strategies", "l2", "--budgets", "24", "--context_lengths", "64",
        "--prefill_chunk_sizes", "none", "16", "--questions", "0", "3", "--dtypes", "float32", "--decode_steps", "3",
        "--device", "cpu", "--checkpoint_path", str(smollm2_checkpoint), "--csv", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    with out.open() as f:
        rows = {(r["chunk"], r["questions"]): r for r in csv.DictReader(f)}
    assert set(rows) == {("", "0"), ("16", "0"), ("", "3"), ("16", "3")}
    assert all(r["error"] == "" for r in rows.values())
    for chunk in ("", "16"):
        assert float(rows[chunk, "0"]["prefill_tok_s"]) > 0 and int(rows[chunk, "0"]["cache_slots"]) == 24
        asked = rows[chunk, "3"]
        assert asked["same_answers"] == "1" and 0 < float(asked["shared_over_separate"]) < 1


@pytest.mark.slow
def test_batch_rows_decode_together_and_beside_their_first_sequence_alone(smollm2_checkpoint, tmp_path):
    out = tmp_path / "bench.csv"
    cmd = [
        sys.executable, str(ROOT / "benchmark.py"), "--strategies", "full", "l2", "--budgets", "0.5",
        "--context_lengths", "40", "--batch_sizes", "1", "3", "--dtypes", "float32", "--decode_steps", "3",
        "--warmup", "1", "--device", "cpu", "--checkpoint_path", str(smollm2_checkpoint), "--csv", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    with out.open() as f:
        rows = {(r["strategy"], r["batch"]): r for r in csv.DictReader(f)}
    assert set(rows) == {("full", "1"), ("full", "3"), ("l2", "1"), ("l2", "3")}
    for strategy in ("full", "l2"):
        alone, batch = rows[strategy, "1"], rows[strategy, "3"]
        assert alone["error"] == batch["error"] == ""
        assert alone["paired_batch_speedup"] == "" and float(batch["paired_batch_speedup"]) > 0
        assert batch["cache_mib"] == alone["cache_mib"] and batch["cache_slots"] == alone["cache_slots"]
        # tokens/s count every sequence of the batch: a step of 3 takes decode_ms for 3 tokens
        assert float(batch["decode_tok_s"]) == pytest.approx(3000 / float(batch["decode_ms"]), rel=1e-3)
    assert "11. decode full @40 float32 eager, batch 3 / alone, steps alternated" in result.stdout
