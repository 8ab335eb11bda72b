"""How a benchmark run is shown: the columns, the printed (or markdown) table, the CSV file and the
target lines. BENCHMARK.md explains every column."""

import csv
import math
import os
import platform
from pathlib import Path

import torch

COLUMNS = [
    "impl",
    "strategy",
    "compressor",
    "budget",
    "context",
    "dtype",
    "mode",
    "cache_bits",
    "chunk",
    "questions",
    "batch",
    "device",
    "threads",
    "cache_slots",
    "prefill_s",
    "prefill_tok_s",
    "decode_steps",
    "decode_ms",
    "decode_tok_s",
    "decode_cpu_ms",
    "prefill_peak_mib",
    "peak_mem_mib",
    "mem_method",
    "cache_mib",
    "compression_ratio",
    "weights_mib",
    "kv_read_mib",
    "bandwidth_gbs",
    "bound_tok_s",
    "frac_of_bound",
    "compile_s",
    "paired_speedup",
    "paired_batch_speedup",
    "steal_pct",
    "shared_s",
    "separate_s",
    "shared_over_separate",
    "same_answers",
    "rounds",
    "tokens_sha",
    "error",
]

# (column, header, format) of the printed table: the main columns; the CSV has them all.
TABLE = [
    ("impl", "impl", "{}"),
    ("strategy", "strategy", "{}"),
    ("budget", "budget", "{:g}"),
    ("context", "ctx", "{}"),
    ("dtype", "dtype", "{}"),
    ("mode", "mode", "{}"),
    ("cache_bits", "bits", "{}"),
    ("chunk", "chunk", "{}"),
    ("questions", "questions", "{}"),
    ("batch", "batch", "{}"),
    ("prefill_tok_s", "prefill tok/s", "{:.0f}"),
    ("decode_tok_s", "decode tok/s", "{:.1f}"),
    ("decode_cpu_ms", "cpu ms/step", "{:.0f}"),
    ("prefill_peak_mib", "prefill MiB", "{:.0f}"),
    ("peak_mem_mib", "peak MiB", "{:.0f}"),
    ("cache_mib", "cache MiB", "{:.1f}"),
    ("compression_ratio", "compr", "{:.2f}"),
    ("bandwidth_gbs", "GB/s", "{:.0f}"),
    ("bound_tok_s", "bound tok/s", "{:.1f}"),
    ("frac_of_bound", "of bound", "{:.0%}"),
    ("compile_s", "compile s", "{:.1f}"),
    ("paired_speedup", "vs eager", "{:.2f}x"),
    ("paired_batch_speedup", "vs alone", "{:.2f}x"),
    ("steal_pct", "steal %", "{:.0f}"),
    ("shared_over_separate", "shared/separate", "{:.2f}x"),
]
CONFIGURATION_COLUMNS = ("impl", "strategy", "budget", "context", "dtype", "mode")  # still shown in a failed row
PROGRESS_COLUMNS = (
    "prefill_tok_s",
    "decode_tok_s",
    "prefill_peak_mib",
    "cache_mib",
    "compile_s",
    "shared_over_separate",
)
BOUND_NOTE = (
    "bound = bandwidth (GB/s: the probe read between the row's decode steps) / (weight bytes + KV bytes"
    " read per token); of bound = those decode steps' tok/s / bound"
)
INFO_NOTE = (
    " (info lines are not judged: eager rows beside the compiled row judged against HF and the bound,"
    " ratios of two rows where steps alternated in the same seconds are judged instead, batch sizes"
    " other than 8 beside their first sequence alone, and compiled tokens compared with float32)"
)


def fmt(value, spec: str) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return spec.format(value)


def format_row(row: dict) -> str:
    """One measured row as a progress line."""
    shown = [(k, label, spec) for k, label, spec in TABLE if k in PROGRESS_COLUMNS and row[k] is not None]
    return ", ".join(f"{label} {fmt(row[k], spec)}" for k, label, spec in shown)


def format_table(rows: list[dict], markdown: bool = False) -> str:
    header = [label for _, label, _ in TABLE]
    cells = [[table_cell(r, k, spec) for k, _, spec in TABLE] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths))
    return "\n".join([line, "-" * len(line)] + ["  ".join(c.rjust(w) for c, w in zip(cell, widths)) for cell in cells])


def table_cell(row: dict, column: str, spec: str) -> str:
    if row["error"] and column not in CONFIGURATION_COLUMNS:
        return "error"
    return fmt(row[column], spec)


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r.get(k) is None else r[k] for k in COLUMNS})


def format_targets(targets: list[dict]) -> str:
    """The target lines, in the order given: [PASS], [FAIL] or [info], then the count of passes."""
    if not targets:
        return "targets: none computable from these rows (see --target_contexts)"
    lines = ["performance targets (ratios within this run):"]
    lines += [format_target(t) for t in targets]
    judged = [t for t in targets if t["passed"] is not None]
    note = INFO_NOTE if len(judged) < len(targets) else ""
    lines.append(f"  {sum(t['passed'] for t in judged)}/{len(judged)} passed{note}")
    return "\n".join(lines)


def format_target(t: dict) -> str:
    value = "" if t["value"] is None else (f"{t['value']:.0%}" if "%" in t["threshold"] else f"{t['value']:.2f}x")
    verdict = {True: "PASS", False: "FAIL", None: "info"}[t["passed"]]
    target = f" (target {t['threshold']})" if t["threshold"] else ""
    return f"  [{verdict}] {t['target']}. {t['what']}: {value}{target}".replace(":  (", ": (").rstrip(": ")


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cpus"
