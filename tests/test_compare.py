"""scripts/compare.py: the bootstrap intervals, the monotonicity flag and the commands (fast), and a
small comparison on the embedded model through the command (slow)."""

import csv

import compare
import pytest


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_samples():
    assert compare.bootstrap_interval([1.0] * 10, seed=0) == (1.0, 1.0)
    few = compare.bootstrap_interval([0.0, 1.0] * 5, seed=0)
    many = compare.bootstrap_interval([0.0, 1.0] * 100, seed=0)
    assert few[0] < 0.5 < few[1] and many[0] < 0.5 < many[1]
    assert many[1] - many[0] < few[1] - few[0]
    assert compare.bootstrap_interval([0.0, 1.0] * 5, seed=0) == few  # seeded


def row(strategy, budget, score, mode="context_only", baseline=False):
    return dict(task="rulerniah", strategy=strategy, mode=mode, budget=budget, score=score, baseline=baseline)


def test_a_curve_that_rises_as_the_budget_falls_is_flagged():
    rows = [row("l2", 0.5, 0.9), row("l2", 0.25, 0.6), row("l2", 0.1, 0.7), row("tova", 0.5, 1.0),
            row("tova", 0.25, 1.0), row("full", 1.0, 0.2, baseline=True)]  # fmt: skip
    flagged = compare.not_monotone(rows)
    assert flagged == ["rulerniah: l2 context_only scores 0.70 at budget 0.1 but 0.60 at 0.25"]


def test_commands_run_the_full_cache_once_per_mode_and_each_strategy_with_its_compressor():
    args = compare.build_parser().parse_args(["--strategies", "l2", "tova", "--budgets", "0.5", "0.25"])
    lines = compare.commands(args, ["--dtype", "float32"])
    assert len(lines) == 2 * (1 + 2 * 2)
    assert sum("--cache_strategy full" in line for line in lines) == 2
    assert sum("--context_only" in line for line in lines) == len(lines) // 2
    assert all("--dtype float32" in line for line in lines)
    assert any(
        "--cache_strategy tova --prompt_compression_strategy tova --max_cache_length 0.25" in line for line in lines
    )


def test_adaptive_head_budgets_run_where_the_compressor_scores_heads_apart():
    argv = ["--strategies", "l2", "tova", "--budgets", "0.25", "--modes", "context_only"]
    lines = compare.commands(compare.build_parser().parse_args([*argv, "--head_budgets", "uniform", "adaptive"]), [])
    assert sum("--head_budgets adaptive" in line for line in lines) == 1  # l2's; tova ranks all heads alike
    assert any("--cache_strategy l2" in line and "--head_budgets adaptive" in line for line in lines)
    assert sum("--head_budgets uniform" in line for line in lines) == 2


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--budgets", "1.0"], "--budgets must be fractions in (0, 1)"),
        (["--strategies", "nope"], "unknown cache strategy 'nope'"),
        (["--tasks", "nope"], "unknown task 'nope'"),
        (["--num_samples", "1"], "--num_samples must be at least 2"),
    ],
)
def test_bad_input_is_one_line(argv, expected, tmp_path):
    with pytest.raises(SystemExit) as exc:
        compare.main([*argv, "--out_dir", str(tmp_path)])
    assert str(exc.value.code).startswith("error:") and expected in str(exc.value.code)


@pytest.mark.slow
def test_comparison_writes_a_table_with_intervals_and_a_plot(smollm2_checkpoint, tmp_path):
    argv = ["--strategies", "l2", "tova", "--budgets", "0.5", "0.25", "--seq_length", "500", "--num_samples", "2",
            "--num_workers", "2", "--out_dir", str(tmp_path), "--", "--max_new_tokens", "8"]  # fmt: skip
    assert compare.main(argv) == 0
    with open(tmp_path / "comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    combos = {(r["strategy"], r["mode"], float(r["budget"])) for r in rows}
    for mode in ("query_aware", "context_only"):
        assert ("full", mode, 1.0) in combos
        for strategy in ("l2", "tova"):
            assert {(strategy, mode, 0.5), (strategy, mode, 0.25)} <= combos
    for r in rows:
        assert float(r["ci_low"]) <= float(r["score"]) <= float(r["ci_high"]) and r["samples"] == "2"
        assert 0 < float(r["kept_fraction"]) <= 1
    assert "score [95% CI]" in (tmp_path / "comparison.md").read_text()
    assert list(tmp_path.glob("comparison__*.png"))
