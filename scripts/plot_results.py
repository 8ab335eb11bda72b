"""Plot eval.py results: each task's metrics, compression ratio and cache memory against the cache budget.

    python scripts/plot_results.py --results_dir results/SmolLM2-135M-Instruct --out_dir plots/

Reads `args.json` and `all_metrics.json` of every configuration folder under `--results_dir` (one
per cache configuration, as eval.py writes them) and draws one line per strategy (cache strategy
plus prompt compressor, and bits / per-layer pattern where set) with the budget
(`--max_cache_length`) on the x axis. The baseline (a cache that keeps every token) is drawn as a
dashed horizontal reference line; every other strategy is a point or a line through its budgets. Writes `<task>__<metric>.png`,
`<task>__compression_ratio.png` and `<task>__cache_memory.png`, and prints a summary table
(also written as `summary.csv`).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import strategies  # noqa: E402


def strategy_label(args: dict) -> str:
    """Cache strategy plus what distinguishes it: prompt compressor, mode, prefill chunks, bits, per-layer patterns."""
    label = "+".join(used_strategies(args))
    compressors = args.get("prompt_compression_strategy") or [strategies.DEFAULT_COMPRESSOR]
    if not is_baseline(args):
        label += f" (prompt: {'+'.join(compressors)})"
    if args.get("context_only"):
        label += " context-only"
    if args.get("prefill_chunk_size"):
        label += f" chunks of {args['prefill_chunk_size']}"
    if args.get("cache_bits"):
        label += f" {args['cache_bits']}-bit"
    lengths = args.get("max_cache_length") or [1.0]
    if len(lengths) > 1 or args.get("cache_length_pattern") in ("pyramid", "funnel"):
        label += f" {args.get('cache_length_pattern', 'tile')}"
    return label


def used_strategies(args: dict) -> list[str]:
    return args.get("cache_strategy") or [strategies.DEFAULT_STRATEGY]


def is_baseline(args: dict) -> bool:
    """Every layer keeps every token: the reference the other strategies are drawn against."""
    return all(name in strategies.baseline_strategies() for name in used_strategies(args))


def budget(args: dict) -> float:
    """The x coordinate: the (mean) `--max_cache_length`; the baseline is 1.0."""
    if is_baseline(args):
        return 1.0
    lengths = [float(v) for v in args.get("max_cache_length") or [1.0]]
    return sum(lengths) / len(lengths)


def load_results(results_dir: Path) -> list[dict]:
    """One record per (configuration folder, task) with metrics and statistics."""
    records = []
    for metrics_path in sorted(results_dir.glob("*/all_metrics.json")):
        folder = metrics_path.parent
        args_path = folder / "args.json"
        try:
            args = json.loads(args_path.read_text())
            all_metrics = json.loads(metrics_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"note: skipping {folder.name}: {e}", file=sys.stderr)
            continue
        for task, result in all_metrics.items():
            records.append(
                {
                    "folder": folder.name,
                    "task": task,
                    "strategy": strategy_label(args),
                    "baseline": is_baseline(args),
                    "budget": budget(args),
                    "metrics": result.get("metrics", {}),
                    "statistics": result.get("statistics", {}),
                    "num_samples": result.get("num_samples"),
                }
            )
    return records


def safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", name)


def draw(records: list[dict], task: str, value, ylabel: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = defaultdict(list)
    baselines = set()
    for r in records:
        y = value(r)
        if y is not None:
            lines[r["strategy"]].append((r["budget"], y))
            if r["baseline"]:
                baselines.add(r["strategy"])
    if not lines:
        return
    budgets = sorted({x for points in lines.values() for x, _ in points})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (strategy, points) in enumerate(sorted(lines.items())):
        points.sort()
        xs, ys = zip(*points)
        color = f"C{i % 10}"
        if strategy in baselines and len(points) == 1:
            ax.axhline(ys[0], color=color, linestyle="--", linewidth=1.2, label=f"{strategy} (baseline)")
            ax.plot(xs, ys, "o", color=color)
        else:
            ax.plot(xs, ys, "o-", color=color, label=strategy)
    ax.set_xlabel("cache budget (--max_cache_length)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{task}: {ylabel}")
    ax.set_xticks(budgets)
    ax.set_xticklabels([f"{b:g}" for b in budgets])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in sorted(records, key=lambda r: (r["task"], r["strategy"], -r["budget"])):
        rows.append(
            {
                "task": r["task"],
                "strategy": r["strategy"],
                "budget": r["budget"],
                **r["metrics"],
                "compression_ratio": r["statistics"].get("compression_ratio"),
                "cache_memory_mib": (r["statistics"].get("cache_memory_bytes") or 0) / 2**20,
                "num_samples": r["num_samples"],
                "folder": r["folder"],
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    columns = list(dict.fromkeys(k for row in rows for k in row if k != "folder"))

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))

    cells = [[fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for line in cells:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths)))


def plot_results(results_dir: Path, out_dir: Path) -> list[Path]:
    records = load_results(results_dir)
    if not records:
        raise ValueError(f"no results under {results_dir}: expected <config folder>/all_metrics.json and args.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    by_task = defaultdict(list)
    for r in records:
        by_task[r["task"]].append(r)
    for task, task_records in sorted(by_task.items()):
        metric_names = sorted({m for r in task_records for m in r["metrics"]})
        plots = [(m, m, lambda r, m=m: r["metrics"].get(m)) for m in metric_names]
        plots.append(("compression_ratio", "compression ratio", lambda r: r["statistics"].get("compression_ratio")))
        plots.append(
            (
                "cache_memory",
                "cache memory (MiB)",
                lambda r: (
                    None
                    if r["statistics"].get("cache_memory_bytes") is None
                    else r["statistics"]["cache_memory_bytes"] / 2**20
                ),
            )
        )
        for name, ylabel, value in plots:
            path = out_dir / f"{safe(task)}__{safe(name)}.png"
            draw(task_records, task, value, ylabel, path)
            if path.is_file():
                written.append(path)
    rows = summary_rows(records)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(out_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print_table(rows)
    return written


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results_dir", type=Path, required=True, help="results/<model>: one folder per config")
    parser.add_argument("--out_dir", type=Path, default=None, help="where PNGs go (default: <results_dir>/plots)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or args.results_dir / "plots"
    if not args.results_dir.is_dir():
        sys.exit(f"error: results folder {args.results_dir} does not exist")
    try:
        written = plot_results(args.results_dir, out_dir)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {len(written)} plots to {out_dir}")
    return written


if __name__ == "__main__":
    main()
