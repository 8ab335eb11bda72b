"""Evaluate one KV-cache configuration on many tasks: predictions, metrics and cache statistics.

    python eval.py --tasks rulerniah rulervt --seq_length 4000 --num_samples 50 --cache_strategy heavy_hitter
    python eval.py --tasks rulerniah:seq_length=8000 quality --data_dir data/ --cache_config heavy_hitter

Task options: `name:key=value[,key=value]` for one task, `--task_options key=value ...` for every
task that has the option, `--seq_length N` for the tasks that take a context length (RULER).
Results go to `<out_dir>/<model>/<folder named by the relevant cache arguments>/`:

    args.json                   the arguments of the last run
    <task>_predictions.csv      one row per sample, appended (and fsynced) as soon as it is finished:
                                id, prompt (as fed to the model), prediction, labels, logprobs
                                (options' log-likelihoods / continuation token log-probs), and the
                                sample's cache statistics and speed
    <task>_metrics.json         the task's metrics and averaged cache statistics
    all_metrics.json            {task: metrics and statistics} for every task run in this folder

Chat models get each prompt in their chat template, the prompt's closing answer line ("Answer:
The special magic numbers ... are") opening the assistant's turn (`--no_chat_template`: raw text).
A task whose options differ from its defaults is named `<task>__<key>=<value>...` there. A killed
run rerun with the same arguments skips the samples already in the CSV; `--overwrite` starts the
tasks afresh. `--batch_size B` decodes a generation task's samples B at a time (each gives the row
it gives alone); a batch's rows are appended as it finishes.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
import time
import zlib
from pathlib import Path

import torch

from cache import check_value
from cache_args import (
    add_cache_arguments,
    add_tokenizer_kwargs,
    check_cache_lengths,
    check_compatibility,
    parse_args_with_cache_config,
    relevant_kwargs,
)
from generation import (
    BACKENDS,
    DEFAULT_CHECKPOINT,
    STEPS,
    CheckpointError,
    answer_questions,
    checkpoint_config,
    compile_steps,
    generate,
    generate_batch,
    load_model,
    peak_memory_bytes,
    resolve_device,
    resolve_dtype,
    score_continuation,
)
from tasks import TASK_REGISTRY, get_task, list_tasks, pick_option
from tokenizer import get_tokenizer

# Per-sample statistics kept in the CSV (and averaged into the metrics).
STAT_COLUMNS = [
    "prompt_tokens",
    "new_tokens",
    "compression_ratio",
    "cache_memory_bytes",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "attention_loss",  # debug_<strategy> runs only
    "seconds",
]
# `logprobs`: the option log-likelihoods (multiple choice) or the token log-probs (perplexity).
CSV_COLUMNS = ["id", "prompt", "prediction", "labels", "logprobs", *STAT_COLUMNS]
# The last line of a task prompt that starts the answer: it goes into the assistant's turn.
ANSWER_PREFIX = re.compile(r"\n((?:Answer|A):[^\n]*)$")
MAX_NAME = 200


class EvalError(ValueError):
    """A user mistake reported in one line."""


# ---- arguments ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tasks", nargs="+", required=True, help="task names, each optionally name:key=value,... (required)"
    )
    parser.add_argument("--task_options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="options for every task that has them, e.g. seq_length=4000 (default: none)")  # fmt: skip
    parser.add_argument(
        "--seq_length", type=int, default=None, help="context length of the RULER tasks (default: each task's own)"
    )
    parser.add_argument(
        "--max_new_tokens", type=int, default=None, help="override the generate tasks' own (default: each task's own)"
    )
    parser.add_argument("--num_samples", type=int, default=None, help="seeded subset per task (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seeds sample choice and generation (default: 0)")
    parser.add_argument(
        "--data_dir", type=Path, default=None, help="local <task>.jsonl/.csv/.parquet files (default: none)"
    )
    parser.add_argument(
        "--checkpoint_path",
        type=Path,
        default=DEFAULT_CHECKPOINT,
        help="converted checkpoint folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="auto: the CPU back-end's kernels on CPU (`make cpu-kernels` builds its C++ ones); "
                        "none: the plain model (default: %(default)s)")  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32 (default: bfloat16)")
    parser.add_argument("--no_chat_template", action="store_true", help="feed prompts as raw text (default: off)")
    parser.add_argument("--out_dir", type=Path, default=Path("results"), help="results root folder (default: results)")
    parser.add_argument(
        "--overwrite", action="store_true", help="discard earlier predictions of these tasks (default: off)"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile prefill and decode (default: off)")
    parser.add_argument("--batch_size", type=int, default=1,
                        help="samples of a generation task decoded together (default: %(default)s)")  # fmt: skip
    add_cache_arguments(parser)
    return parser


def parse_value(text: str):
    """`4000` -> 4000, `0.5` -> 0.5, `true` -> True, `null` -> None, anything else stays a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_options(items: list[str], where: str) -> dict:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise EvalError(f"{where}: expected key=value, got '{item}'")
        options[key.strip()] = parse_value(value.strip())
    return options


def resolve_tasks(args) -> list[tuple[str, object]]:
    """(label, task) per `--tasks` entry; options: specific flags < --task_options < name:key=value."""
    shared = parse_options(args.task_options, "--task_options")
    specs = []
    for spec in args.tasks:
        name, _, rest = spec.partition(":")
        own = parse_options([p for p in re.split(r"[,:]", rest) if p], f"--tasks {spec}") if rest else {}
        specs.append((name.strip(), own))
    used = set()
    result = []
    for name, own in specs:
        if name not in TASK_REGISTRY:
            raise EvalError(f"unknown task '{name}'; choose from: {', '.join(list_tasks())}")
        cls = TASK_REGISTRY[name]
        accepted = {"max_new_tokens", *cls.option_defaults}
        options = {}
        if args.seq_length is not None and "seq_length" in accepted:
            options["seq_length"] = args.seq_length
            used.add("--seq_length")
        if args.max_new_tokens is not None and cls.kind == "generate":
            options["max_new_tokens"] = args.max_new_tokens
            used.add("--max_new_tokens")
        for key, value in shared.items():
            if key in accepted:
                options[key] = value
                used.add(key)
        options.update(own)
        try:
            task = get_task(name, **options)
        except ValueError as e:
            raise EvalError(str(e)) from None
        if task.kind == "generate" and task.max_new_tokens < 1:
            raise EvalError(f"task '{name}' generates text: max_new_tokens must be at least 1")
        result.append((task_label(task, options), task))
    for flag in ("--seq_length", "--max_new_tokens"):
        if getattr(args, flag[2:]) is not None and flag not in used:
            raise EvalError(f"{flag} applies to none of the tasks {', '.join(n for n, _ in specs)}")
    unused = sorted(set(shared) - used)
    if unused:
        raise EvalError(f"--task_options {unused[0]}: none of the tasks has this option")
    labels = [label for label, _ in result]
    if len(set(labels)) != len(labels):
        raise EvalError("the same task (with the same options) is listed twice in --tasks")
    return result


# ---- names ----------------------------------------------------------------------------------


def format_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return "-".join(format_value(v) for v in value)
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (str, Path)) and ("/" in str(value) or os.sep in str(value)):
        value = Path(value).stem
    return str(value)


def safe_name(parts: list[str]) -> str:
    """Joins parts with '__', keeping only filesystem-safe characters; long names end in a hash."""
    name = "__".join(re.sub(r"[^A-Za-z0-9._=+-]", "_", p) for p in parts)
    if len(name) > MAX_NAME:
        digest = f"{zlib.crc32(name.encode()):08x}"
        name = f"{name[: MAX_NAME - 10]}__{digest}"
    return name


def config_folder_name(cache_kwargs: dict) -> str:
    """`<strategy>__key=value__...` from the cache arguments the chosen strategies read (sorted)."""
    rel = relevant_kwargs(cache_kwargs)
    parts = [format_value(rel["cache_strategy"])]
    parts += [f"{k}={format_value(rel[k])}" for k in sorted(rel) if k != "cache_strategy"]
    return safe_name(parts)


def task_label(task, options: dict) -> str:
    """The task name, plus its options that differ from the defaults (sorted)."""
    defaults = {"max_new_tokens": type(task).max_new_tokens, **type(task).option_defaults}
    changed = sorted(k for k in options if getattr(task, k) != defaults.get(k))
    return safe_name([task.name] + [f"{k}={format_value(getattr(task, k))}" for k in changed])


# ---- files ----------------------------------------------------------------------------------


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_csv_atomic(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_predictions(path: Path) -> dict[str, dict]:
    """Finished rows by sample id. An incomplete trailing row (a run killed mid-write) is dropped
    and the file rewritten without it; a duplicated id keeps its first row."""
    if not path.is_file():
        return {}
    text = path.read_bytes().decode("utf-8", errors="replace")
    records = []
    try:
        records.extend(csv.reader(io.StringIO(text, newline="")))
    except csv.Error:
        pass  # damaged tail: only the records before it count
    if not records or records[0] != CSV_COLUMNS:
        if not records or (len(records) == 1 and not text.endswith("\n")):  # killed while writing the header
            write_csv_atomic(path, [])
            return {}
        raise EvalError(f"{path} has other columns than eval.py writes; pass --overwrite or another --out_dir")
    body = records[1:]
    damaged = False
    if body and (not text.endswith("\n") or len(body[-1]) != len(CSV_COLUMNS)):
        body, damaged = body[:-1], True
    rows: dict[str, dict] = {}
    for i, record in enumerate(body, 2):
        if len(record) != len(CSV_COLUMNS):
            raise EvalError(f"{path} record {i}: {len(record)} fields, expected {len(CSV_COLUMNS)}; pass --overwrite")
        row = dict(zip(CSV_COLUMNS, record))
        if row["id"] in rows:
            damaged = True
            continue
        rows[row["id"]] = row
    if damaged:
        print(f"note: {path}: dropped an incomplete or duplicated row; its sample will be run again")
        write_csv_atomic(path, list(rows.values()))
    return rows


class PredictionWriter:
    """Appends one CSV row per finished sample, flushed and fsynced so a kill loses at most one."""

    def __init__(self, path: Path):
        new = not path.is_file() or path.stat().st_size == 0
        self.file = open(path, "a", newline="", encoding="utf-8")
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_COLUMNS, lineterminator="\n")
        if new:
            self.writer.writeheader()
            self.sync()

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def write(self, row: dict) -> None:
        self.writer.writerow(row)
        self.sync()

    def close(self) -> None:
        self.file.close()


def prepare_out_dir(folder: Path) -> None:
    """Creates the results folder and proves it is writable (before any model is loaded)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_probe.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise EvalError(f"output folder {folder} is not writable ({e.strerror or type(e).__name__})") from None


class LockBusy(Exception):
    pass


def lock(path: Path, wait: bool):
    """An exclusive flock on `path`, released when closed or when the process dies (None where
    there is no fcntl). Without `wait`, raises LockBusy if another process holds it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        return None
    handle = open(path, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        handle.close()
        raise LockBusy(path) from None
    return handle


def lock_tasks(folder: Path, labels: list[str]) -> list:
    """One lock per task, so two runs never append to the same predictions (runs of other tasks in
    the same folder, e.g. parallel_eval.py jobs, are fine)."""
    handles = []
    try:
        for label in labels:
            handles.append(lock(folder / f".{label}.lock", wait=False))
    except LockBusy:
        for handle in handles:
            if handle is not None:
                handle.close()
        raise EvalError(
            f"another eval.py is running task '{label}' in {folder}; wait for it or use another --out_dir"
        ) from None
    return handles


def update_all_metrics(folder: Path, update) -> None:
    """Read-modify-write of all_metrics.json under a lock shared by every run in the folder."""
    handle = lock(folder / ".all_metrics.lock", wait=True)
    try:
        path = folder / "all_metrics.json"
        all_metrics = json.loads(path.read_text()) if path.is_file() else {}
        update(all_metrics)
        write_json_atomic(path, all_metrics)
    finally:
        if handle is not None:
            handle.close()


# ---- running samples ------------------------------------------------------------------------


def model_input(tokenizer, prompt: str, kind: str, chat: bool) -> str:
    """The text fed to the model. A chat model gets the prompt as the user's turn, except its last
    line when that starts the answer ('Answer: The numbers are'): as RULER does with its answer
    prefix, the text after the label opens the assistant's turn. Perplexity prompts (book text)
    stay raw."""
    if not chat or kind == "perplexity" or not tokenizer.is_chat:
        return prompt
    match = ANSWER_PREFIX.search(prompt)
    if match is None:
        return tokenizer.apply_chat_template(prompt)
    answer_start = match.group(1).split(":", 1)[1].strip()  # 'Answer: The numbers are' -> 'The numbers are'
    return tokenizer.apply_chat_template(prompt[: match.start()]) + answer_start


def seed_for(seed: int, sample_id: str) -> int:
    """A per-sample seed: a resumed run draws the same random numbers as an uninterrupted one."""
    return zlib.crc32(f"{seed}|{sample_id}".encode())


def encode_sample(tokenizer, task, sample, chat: bool) -> tuple[str, list[int], int]:
    """The model's text, its token ids and how many of them are the context (all when the task's
    prompt has no question apart from it): the context is tokenized on its own in both modes, so
    query-aware and context-only runs see the same tokens."""
    text = model_input(tokenizer, sample.prompt, task.kind, chat)
    boundary = len(text)
    if sample.context_end is not None:
        head = sample.prompt[: sample.context_end]
        boundary = text.index(head) + len(head)
    ids, context_length = tokenizer.encode_split(text, boundary)
    return text, ids, context_length


def run_sample(model, tokenizer, task, sample, chat: bool, cache_kwargs: dict, steps: dict, seed: int) -> dict:
    torch.manual_seed(seed_for(seed, sample.id))
    text, ids, context_length = encode_sample(tokenizer, task, sample, chat)
    prompt_ids = torch.tensor(ids, dtype=torch.long)
    context_length = context_length if cache_kwargs.get("context_only") else None
    start = time.perf_counter()
    logprobs = ""
    if task.kind == "generate":
        tokens, stats = generate(
            model,
            prompt_ids,
            task.max_new_tokens,
            cache_kwargs,
            terminator_ids=tokenizer.terminator_ids,
            steps=steps,
            context_length=context_length,
        )
        prediction = tokenizer.decode_answer(tokens)
    elif task.kind == "multiple_choice":
        lls, all_stats = [], []
        for option in sample.options:
            option_ids = torch.tensor(tokenizer.encode(option, bos=False), dtype=torch.long)
            token_logprobs, stats = score_continuation(
                model, prompt_ids, option_ids, cache_kwargs, steps, context_length
            )
            lls.append(float(token_logprobs.sum()))
            all_stats.append(stats)
        stats = {k: mean([s[k] for s in all_stats]) for k in STAT_COLUMNS if k in all_stats[0]}
        prediction = sample.options[pick_option(lls)]
        logprobs = json.dumps(lls)
    else:  # perplexity
        cont_ids = torch.tensor(tokenizer.encode(sample.continuation, bos=False), dtype=torch.long)
        token_logprobs, stats = score_continuation(model, prompt_ids, cont_ids, cache_kwargs, steps, context_length)
        values = token_logprobs.tolist()
        prediction = f"{math.exp(-sum(values) / len(values)):.6g}"
        logprobs = json.dumps(values)
    stats["seconds"] = time.perf_counter() - start
    return prediction_row(sample, text, prediction, logprobs, stats)


def prediction_row(sample, text: str, prediction: str, logprobs: str, stats: dict) -> dict:
    row = {"id": sample.id, "prompt": text, "prediction": prediction, "labels": json.dumps(sample.labels)}
    row["logprobs"] = logprobs
    row.update({k: "" if stats.get(k) is None else stats[k] for k in STAT_COLUMNS})
    return row


def shared_context(sample) -> str:
    """The group of samples asking about the same context (the sample alone, for most tasks)."""
    return sample.meta.get("group", sample.id)


def group_by_context(samples) -> list[list]:
    """Consecutive samples that share a context, in sample order."""
    groups: list[list] = []
    for sample in samples:
        if groups and shared_context(groups[-1][-1]) == shared_context(sample):
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def encode_group(tokenizer, task, group, chat: bool) -> tuple[dict, list[int], int]:
    """Each sample's (text, ids, context length) by id, their shared context's ids, and the room
    its cache keeps for questions: the longest question of the whole group, so that a resumed run
    compresses the context as the first did."""
    encoded = {s.id: encode_sample(tokenizer, task, s, chat) for s in group}
    _, first, length = encoded[group[0].id]
    context = first[:length]
    if any(ids[:length] != context for _, ids, length in encoded.values()):
        raise ValueError(f"task '{task.name}': the samples of {shared_context(group[0])} differ in their context")
    return encoded, context, max(len(ids) - length for _, ids, length in encoded.values())


def run_shared_context(model, tokenizer, task, group, todo, chat: bool, cache_kwargs: dict, steps: dict, seed: int):
    """Rows for the `todo` samples of a group, each answered from one compressed copy of their
    context (context-only); yields each row as its answer finishes."""
    encoded, context, room = encode_group(tokenizer, task, group, chat)
    questions = [torch.tensor(encoded[s.id][1][encoded[s.id][2] :], dtype=torch.long) for s in todo]
    torch.manual_seed(seed_for(seed, shared_context(group[0])))
    answers = answer_questions(
        model, torch.tensor(context, dtype=torch.long), questions, task.max_new_tokens, cache_kwargs,
        tokenizer.terminator_ids, steps, room, seeds=[seed_for(seed, s.id) for s in todo],
    )  # fmt: skip
    for sample, (tokens, stats) in zip(todo, answers):
        stats["seconds"] = stats["prefill_time"] + stats["decode_time"]
        yield prediction_row(sample, encoded[sample.id][0], tokenizer.decode_answer(tokens), "", stats)


def run_batch(model, tokenizer, task, batch, chat: bool, cache_kwargs: dict, steps: dict, seed: int):
    """Rows for generation samples decoded together, each prefilled alone and seeded as run_sample
    seeds it, so each row is the one it gives alone; yields them in order once the batch is done."""
    encoded = [encode_sample(tokenizer, task, s, chat) for s in batch]
    context_only = cache_kwargs.get("context_only")
    results = generate_batch(
        model, [torch.tensor(ids, dtype=torch.long) for _, ids, _ in encoded], task.max_new_tokens, cache_kwargs,
        tokenizer.terminator_ids, steps=steps, seeds=[seed_for(seed, s.id) for s in batch],
        context_lengths=[length if context_only else None for _, _, length in encoded],
    )  # fmt: skip
    for sample, (text, _, _), (tokens, stats) in zip(batch, encoded, results):
        stats["seconds"] = stats["prefill_time"] + stats["decode_time"]
        yield prediction_row(sample, text, tokenizer.decode_answer(tokens), "", stats)


def mean(values) -> float | None:
    """Mean of the numbers among `values` (CSV strings included), ignoring blanks and NaN."""
    numbers = []
    for v in values:
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if not math.isnan(x):
            numbers.append(x)
    return sum(numbers) / len(numbers) if numbers else None


def task_metrics(task, samples, rows: dict[str, dict]) -> dict:
    """Metrics over the current samples' rows, with the averaged per-sample statistics."""
    chosen = [rows[s.id] for s in samples]
    if task.kind == "perplexity":
        predictions = [json.loads(r["logprobs"]) for r in chosen]
    else:
        predictions = [r["prediction"] for r in chosen]
    metrics = task.score(predictions, [s.labels for s in samples])
    return {
        "task": task.name,
        "options": {k: getattr(task, k) for k in ["max_new_tokens", *type(task).option_defaults]},
        "num_samples": len(samples),
        "metrics": metrics,
        "statistics": {k: mean([r[k] for r in chosen]) for k in STAT_COLUMNS},
    }


# ---- main -----------------------------------------------------------------------------------


def prepare(args):
    """Every check that needs no model weights: returns what the run needs, or raises."""
    if args.num_samples is not None and args.num_samples < 1:
        raise EvalError(f"--num_samples must be at least 1, got {args.num_samples} (omit it for all samples)")
    check_value("--batch_size", args.batch_size, minimum=1)
    for flag, value in (("--max_new_tokens", args.max_new_tokens), ("--seq_length", args.seq_length)):
        if value is not None:
            check_value(flag, value, minimum=1)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    tasks = resolve_tasks(args)
    config = checkpoint_config(args.checkpoint_path)
    cache_kwargs = dict(vars(args))
    check_compatibility(cache_kwargs, config.n_layer, compile=args.compile)
    folder = args.out_dir / Path(args.checkpoint_path).name / config_folder_name(cache_kwargs)
    prepare_out_dir(folder)
    tokenizer = get_tokenizer(args.checkpoint_path)
    cache_kwargs = add_tokenizer_kwargs(cache_kwargs, tokenizer)
    chat = not args.no_chat_template and tokenizer.is_chat
    overhead = len(tokenizer.encode(tokenizer.apply_chat_template(""))) + 8 if chat else 1
    prepared = []
    for label, task in tasks:
        budget = config.block_size - task.max_new_tokens - (overhead if task.kind != "perplexity" else 1)
        samples = task.samples(tokenizer, budget, args.num_samples, args.seed, args.data_dir)
        if not samples:
            raise EvalError(f"task '{label}': no sample fits the model's context of {config.block_size} tokens")
        new_tokens = max(1, task.max_new_tokens)
        for group in group_by_context(samples):  # cache sizes depend on each prompt: check them before the model loads
            room = encode_group(tokenizer, task, group, chat)[2] if args.context_only else 0
            for sample in group:
                check_cache_lengths(cache_kwargs, config.n_layer, sample.prompt_tokens, new_tokens, room)
        prepared.append((label, task, samples))
    return device, dtype, config, cache_kwargs, folder, tokenizer, chat, prepared


def discard_results(folder: Path, labels: list[str]) -> None:
    """--overwrite: the earlier predictions and metrics of these tasks go; other tasks' stay."""
    for label in labels:
        for path in (folder / f"{label}_predictions.csv", folder / f"{label}_metrics.json"):
            path.unlink(missing_ok=True)

    def drop(all_metrics):
        for label in labels:
            all_metrics.pop(label, None)

    update_all_metrics(folder, drop)


def check_previous_args(folder: Path, args_record: dict) -> None:
    """Predictions made with another dtype or prompt format must not be mixed in."""
    path = folder / "args.json"
    if not path.is_file():
        return
    try:
        previous = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return
    for key in ("dtype", "no_chat_template"):
        if key in previous and previous[key] != args_record[key]:
            raise EvalError(
                f"{folder} holds results made with {key}={previous[key]} (now {args_record[key]}); "
                "pass --overwrite or another --out_dir"
            )


def main(argv=None) -> dict:
    """Runs eval.py; returns {task label: metrics and statistics}."""
    parser = build_parser()
    args = parse_args_with_cache_config(parser, argv)
    locks = []
    try:
        try:
            device, dtype, config, cache_kwargs, folder, tokenizer, chat, prepared = prepare(args)
            labels = [label for label, _, _ in prepared]
            locks = lock_tasks(folder, labels)
            args_record = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
            if not args.overwrite:
                check_previous_args(folder, args_record)
            for label in labels:  # temporary files left by a run of these tasks killed mid-write
                for name in (f"{label}_predictions.csv", f"{label}_metrics.json"):
                    for stale in folder.glob(f".{name}.*.tmp"):
                        stale.unlink(missing_ok=True)
            if args.overwrite:
                discard_results(folder, labels)
            existing = {label: read_predictions(folder / f"{label}_predictions.csv") for label in labels}
            model = load_model(args.checkpoint_path, device, dtype, backend=args.backend)
        except (ValueError, CheckpointError, FileNotFoundError) as e:
            sys.exit(f"error: {e}")
        args_record["model"] = Path(args.checkpoint_path).name
        args_record["relevant_cache_kwargs"] = relevant_kwargs(cache_kwargs)
        args_record["task_labels"] = labels
        write_json_atomic(folder / "args.json", args_record)
        print(f"results: {folder}")
        steps = compile_steps(STEPS, device) if args.compile else STEPS
        results = {}
        for label, task, samples in prepared:
            run = (model, tokenizer, chat, cache_kwargs, steps, args.seed, args.batch_size)
            result = evaluate_task(folder, label, task, samples, existing[label], run)
            result["statistics"]["peak_memory_bytes"] = peak_memory_bytes(device)
            write_json_atomic(folder / f"{label}_metrics.json", result)
            update_all_metrics(
                folder, lambda all_metrics, label=label, result=result: all_metrics.update({label: result})
            )
            results[label] = result
            shown = ", ".join(f"{k}={v:.4g}" for k, v in result["metrics"].items())
            print(f"{label}: {shown}; compression ratio {result['statistics']['compression_ratio']:.4f}")
        return results
    finally:
        for handle in locks:
            if handle is not None:
                handle.close()


def evaluate_task(folder: Path, label: str, task, samples, rows: dict, run: tuple) -> dict:
    """Runs the samples not yet in `rows`, appending each finished one to the CSV; returns metrics."""
    from tqdm import tqdm

    model, tokenizer, chat, cache_kwargs, steps, seed, batch_size = run
    todo = {s.id for s in samples if s.id not in rows}
    writer = PredictionWriter(folder / f"{label}_predictions.csv")
    bar = tqdm(total=len(samples), initial=len(samples) - len(todo), desc=label, unit="sample", dynamic_ncols=True)
    shared = cache_kwargs.get("context_only") and task.kind == "generate"
    batch_size = batch_size if task.kind == "generate" else 1
    try:
        for group, waiting in work_units(samples, todo, shared, batch_size):
            if group:
                finished = run_shared_context(model, tokenizer, task, group, waiting, chat, cache_kwargs, steps, seed)
            elif len(waiting) > 1:
                finished = run_batch(model, tokenizer, task, waiting, chat, cache_kwargs, steps, seed)
            else:
                finished = (run_sample(model, tokenizer, task, s, chat, cache_kwargs, steps, seed) for s in waiting)
            for sample, row in zip(waiting, finished):
                writer.write(row)
                rows[sample.id] = {k: str(v) for k, v in row.items()}
                bar.set_postfix(compression=f"{float(row['compression_ratio']):.2f}", refresh=False)
                bar.update(1)
    finally:
        bar.close()
        writer.close()
    return task_metrics(task, samples, rows)


def work_units(samples, todo: set, shared: bool, batch_size: int) -> list[tuple[list | None, list]]:
    """The waiting samples, in sample order, as units of work: (group, its waiting samples) for a
    group answered from one shared context, else (None, up to batch_size samples run together)."""
    units: list[tuple[list | None, list]] = []
    for group in group_by_context(samples):
        waiting = [s for s in group if s.id in todo]
        if shared and len(group) > 1 and waiting:
            units.append((group, waiting))
            continue
        for sample in waiting:
            if units and units[-1][0] is None and len(units[-1][1]) < batch_size:
                units[-1][1].append(sample)
            else:
                units.append((None, [sample]))
    return units


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
