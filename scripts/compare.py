"""Compare strategies honestly: strategies x budgets x modes (query-aware, context-only) x tasks, with
95% bootstrap confidence intervals over samples.

    python scripts/compare.py --strategies recent_global l2 tova keydiff expected_attention kvzip \
        --budgets 0.5 0.25 0.1 --tasks rulerniah rulervt --num_samples 20 --num_workers 2

Every configuration runs as one eval.py job (each strategy with its natural prompt compressor) through
scripts/parallel_eval.py, so finished jobs are skipped and interrupted ones resume; the full cache
runs once per mode as the baseline. Then it writes, in `--out_dir`: `comparison.csv` and
`comparison.md` (one row per task, strategy, mode and budget: the mean score over samples, its 95%
bootstrap interval, the kept fraction of the cache and the samples), and `comparison__<task>.png`
(score against kept fraction, one line per strategy and mode, error bars from the intervals, the full
cache as a horizontal line). A curve whose score rises as its budget falls is flagged as not monotone.
Arguments after `--` go to every eval.py job (e.g. `-- --dtype float32`).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import shlex
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import parallel_eval  # noqa: E402
import plot_results  # noqa: E402

import strategies  # noqa: E402
from cache import HEAD_BUDGETS  # noqa: E402
from tasks import get_task  # noqa: E402

MODES = {"query_aware": [], "context_only": ["--context_only"]}
BOOTSTRAP_RESAMPLES = 2000
COLUMNS = ["task", "strategy", "mode", "budget", "score", "ci_low", "ci_high", "kept_fraction", "cache_mib", "samples"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    compressing = [n for n in strategies.STRATEGIES if not strategies.strategy_class(n).spans_sequence]
    parser.add_argument("--strategies", nargs="+", default=compressing,
                        help=f"compressing strategies (default: {' '.join(compressing)})")  # fmt: skip
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.25, 0.1], help="--max_cache_length values")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--head_budgets", nargs="+", choices=HEAD_BUDGETS, default=["uniform"],
                        help="uniform and/or adaptive (AdaKV) head budgets, for the strategies whose compressor "
                        "scores heads apart (default: uniform)")  # fmt: skip
    parser.add_argument("--tasks", nargs="+", default=["rulerniah"], help="eval.py tasks (default: rulerniah)")
    parser.add_argument("--seq_length", type=int, default=2000, help="RULER prompt tokens (default: 2000)")
    parser.add_argument("--num_samples", type=int, default=20)
    parser.add_argument("--num_workers", type=int, default=None, help="parallel eval.py jobs (runner's default)")
    parser.add_argument("--out_dir", type=Path, default=Path("results/comparison"))
    parser.add_argument("--seed", type=int, default=0, help="seeds the samples and the bootstrap")
    return parser


def commands(args, extra: list[str]) -> list[str]:
    """One eval.py command per configuration: the full cache once per mode, then the grid."""
    common = ["--tasks", *args.tasks, "--seq_length", str(args.seq_length), "--num_samples", str(args.num_samples),
              "--seed", str(args.seed), "--out_dir", str(args.out_dir), *extra]  # fmt: skip
    configs = [["--cache_strategy", "full"]]
    for name in args.strategies:
        compressor = strategies.natural_compressor(name)
        for head_budgets in args.head_budgets:
            if head_budgets == "adaptive" and not strategies.ranks_heads_apart(name, compressor):
                continue
            for budget in args.budgets:
                configs.append(["--cache_strategy", name, "--prompt_compression_strategy", compressor,
                                "--max_cache_length", f"{budget:g}", "--head_budgets", head_budgets])  # fmt: skip
    return [
        shlex.join([sys.executable, str(ROOT / "eval.py"), *config, *common, *MODES[mode]])
        for mode in args.modes
        for config in configs
    ]


def bootstrap_interval(scores: list[float], seed: int, resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the mean of `scores`."""
    rng = random.Random(seed)
    n = len(scores)
    means = sorted(sum(rng.choices(scores, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


def sample_scores(folder: Path, label: str, task_name: str) -> list[float]:
    """Each sample's score (the task's first metric) from an eval.py predictions file."""
    task = get_task(task_name)
    with open(folder / f"{label}_predictions.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    metric = task.metrics[0]
    return [task.score([r["prediction"]], [json.loads(r["labels"])])[metric] for r in rows]


def collect(results_dir: Path, seed: int) -> list[dict]:
    """One row per (task, configuration) found under results_dir."""
    rows = []
    for metrics_path in sorted(results_dir.glob("*/all_metrics.json")):
        folder = metrics_path.parent
        run_args = json.loads((folder / "args.json").read_text())
        for label, result in json.loads(metrics_path.read_text()).items():
            scores = sample_scores(folder, label, result["task"])
            low, high = bootstrap_interval(scores, seed)
            rows.append({
                "task": label,
                "strategy": "+".join(plot_results.used_strategies(run_args))
                + ("/adaptive" if run_args.get("head_budgets") == "adaptive" else ""),
                "mode": "context_only" if run_args.get("context_only") else "query_aware",
                "budget": plot_results.budget(run_args),
                "score": sum(scores) / len(scores),
                "ci_low": low,
                "ci_high": high,
                "kept_fraction": 1 - result["statistics"]["compression_ratio"],
                "cache_mib": result["statistics"]["cache_memory_bytes"] / 2**20,
                "samples": len(scores),
                "baseline": plot_results.is_baseline(run_args),
            })  # fmt: skip
    return sorted(rows, key=lambda r: (r["task"], not r["baseline"], r["strategy"], r["mode"], -r["budget"]))


def not_monotone(rows: list[dict]) -> list[str]:
    """Curves (task, strategy, mode) whose mean score rises where the budget falls."""
    curves = defaultdict(list)
    for r in rows:
        if not r["baseline"]:
            curves[r["task"], r["strategy"], r["mode"]].append((r["budget"], r["score"]))
    flagged = []
    for (task, strategy, mode), points in sorted(curves.items()):
        points.sort()
        for (low_budget, low_score), (high_budget, high_score) in zip(points, points[1:]):
            if low_score > high_score:
                flagged.append(f"{task}: {strategy} {mode} scores {low_score:.2f} at budget {low_budget:g} "
                               f"but {high_score:.2f} at {high_budget:g}")  # fmt: skip
    return flagged


def write_table(rows: list[dict], out_dir: Path) -> None:
    with open(out_dir / "comparison.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| task | strategy | mode | budget | score [95% CI] | kept | cache MiB | samples |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        interval = f"{r['score']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"
        lines.append(f"| {r['task']} | {r['strategy']} | {r['mode']} | {r['budget']:g} | {interval} | "
                     f"{r['kept_fraction']:.2f} | {r['cache_mib']:.1f} | {r['samples']} |")  # fmt: skip
    (out_dir / "comparison.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def draw(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task in dict.fromkeys(r["task"] for r in rows):
        fig, ax = plt.subplots(figsize=(8, 5))
        curves = defaultdict(list)
        for r in (r for r in rows if r["task"] == task):
            if r["baseline"]:
                ax.axhline(r["score"], linestyle="--", color="gray", label=f"full cache ({r['mode']})")
            else:
                curves[r["strategy"], r["mode"]].append(r)
        colors = {name: plt.cm.tab20(i % 20) for i, name in enumerate(sorted({name for name, _ in curves}))}
        for (strategy, mode), points in sorted(curves.items()):
            points.sort(key=lambda r: r["kept_fraction"])
            xs, ys = [r["kept_fraction"] for r in points], [r["score"] for r in points]
            errors = [[y - r["ci_low"] for y, r in zip(ys, points)], [r["ci_high"] - y for y, r in zip(ys, points)]]
            style, marker = ("-", "o") if mode == "query_aware" else (":", "s")
            ax.errorbar(xs, ys, yerr=errors, marker=marker, linestyle=style, capsize=3, color=colors[strategy],
                        label=f"{strategy} ({mode})")  # fmt: skip
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("kept fraction of the cache")
        ax.set_ylabel("score (95% bootstrap CI)")
        ax.set_title(task)
        ax.legend(fontsize="x-small", ncol=2)
        path = out_dir / f"comparison__{plot_results.safe(task)}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = build_parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        for name in args.strategies:
            strategies.strategy_class(name)
        for task in args.tasks:
            get_task(task)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if any(not 0 < b < 1 for b in args.budgets):
        sys.exit("error: --budgets must be fractions in (0, 1); the full cache runs as the baseline")
    if args.num_samples < 2:
        sys.exit("error: --num_samples must be at least 2 for a confidence interval")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    command_file = args.out_dir / "commands.txt"
    command_file.write_text("\n".join(commands(args, extra)) + "\n")
    runner = ["--command_file", str(command_file), "--out_dir", str(args.out_dir)]
    status = parallel_eval.main(runner + (["--num_workers", str(args.num_workers)] if args.num_workers else []))
    model_dirs = [p.parent.parent for p in args.out_dir.glob("*/*/all_metrics.json")]
    rows = [r for model_dir in dict.fromkeys(model_dirs) for r in collect(model_dir, args.seed)]
    if not rows:
        sys.exit(f"error: no results under {args.out_dir}")
    write_table(rows, args.out_dir)
    for line in not_monotone(rows):
        print(f"not monotone: {line}")
    for path in draw(rows, args.out_dir):
        print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
