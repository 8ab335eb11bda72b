"""The task base class: what every evaluation task provides, and the shared sample pipeline.

A task turns raw rows (generated locally, read from ``--data_dir``, or fetched from the HF hub)
into `Sample`s that eval.py feeds to a model, then scores the model's outputs with its metrics.
Subclasses mostly set class attributes (template, columns, metrics, hub source); the few that
need a tokenizer to build a prompt (RULER, PG-19) override `expand`.
"""

from __future__ import annotations

import csv
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from tasks import metrics as M

KINDS = ("generate", "multiple_choice", "perplexity")
FILE_TYPES = (".jsonl", ".csv", ".parquet")

# Where a hub data set names a column differently, the first of these names that a row has is used.
COLUMN_ALIASES = {
    "context": (
        "context",
        "document",
        "article",
        "story",
        "transcript",
        "input",
        "text",
    ),
    "question": ("question", "query", "instruction", "prompt"),
    "answers": (
        "answers",
        "answer",
        "output",
        "outputs",
        "summary",
        "summaries",
        "target",
    ),
}


@dataclass
class Sample:
    """One model input. `id` is stable across runs (eval.py resumes by it)."""

    id: str
    prompt: str
    labels: list[str]
    options: list[str] | None = None  # multiple choice: exact continuation strings to score
    answer_index: int | None = None  # multiple choice: index of the correct option
    continuation: str | None = None  # perplexity: text teacher-forced after the prompt
    context_end: int | None = None  # prompt[:context_end] is the context, the rest the question; None: no question
    prompt_tokens: int = 0  # len(tokenizer.encode(prompt))
    total_tokens: int = 0  # prompt + longest option / continuation: what the model must hold
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class Task:
    """Base task. Override class attributes; override methods only where a task differs."""

    name = ""
    kind = "generate"
    max_new_tokens = 32
    metrics: tuple[str, ...] = ()
    template = "{context}\n\nQuestion: {question}\nAnswer:"
    context_field = "context"  # the template field that is the context; what follows it is the question
    columns: tuple[str, ...] = ()  # required columns of a local data file
    list_columns: tuple[str, ...] = ("answers",)  # columns holding a list of strings
    hub: tuple[str, str | None, str] | None = None  # (path, config, split) for datasets.load_dataset
    option_defaults: ClassVar[dict] = {}  # task options accepted by get_task(name, **options)

    def __init__(self, **options):
        allowed = {"max_new_tokens": self.max_new_tokens, **self.option_defaults}
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(
                f"task '{self.name}' has no option {', '.join(unknown)}; its options are: {', '.join(sorted(allowed))}"
            )
        for key, default in allowed.items():
            setattr(self, key, options.get(key, default))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"task '{self.name}': max_new_tokens must be an integer >= 0")

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.option_defaults)
        return f"{type(self).__name__}({opts})"

    # ---- raw rows -------------------------------------------------------------------------

    def load(self, data_dir: str | Path | None = None) -> list[dict]:
        """Raw rows: from `<data_dir>/<name>.jsonl|.csv|.parquet`, else from the HF hub."""
        if data_dir is not None:
            path = find_data_file(data_dir, self.name, self.columns)
            located = read_table(path, self.columns)
        else:
            located = self._load_hub()
        return [self.check_row(row, where) for where, row in located]

    def _load_hub(self):
        cols = ", ".join(self.columns)
        hint = f"pass --data_dir DIR holding {self.name}.jsonl (or .csv/.parquet) with columns: {cols}"
        if self.hub is None:
            raise ValueError(f"task '{self.name}' has no HF hub source; {hint}")
        try:
            import datasets
        except ImportError:
            raise ValueError(f"task '{self.name}': the 'datasets' package is not installed; {hint}") from None
        path, config, split = self.hub
        try:
            rows = datasets.load_dataset(path, config, split=split)
        except Exception as e:  # offline, gated, renamed ...: all end the same way
            first = (str(e).splitlines() or [""])[0][:200]
            raise ValueError(
                f"task '{self.name}': could not load {path} from the HF hub ({type(e).__name__}: {first}); {hint}"
            ) from None
        located = []
        for i, raw in enumerate(rows):
            where = f"{path} ({split}) row {i}"
            row = self.from_hub(dict(raw))
            missing = [c for c in self.columns if c not in row]
            if missing:
                raise ValueError(f"{where}: missing column(s) {', '.join(missing)}; {hint}")
            located.append((where, row))
        return located

    def from_hub(self, row: dict) -> dict:
        """Map a hub row onto this task's columns (generic: first matching alias)."""
        out = dict(row)
        for col in self.columns:
            for alias in COLUMN_ALIASES.get(col, ()):
                if col not in out and alias in row:
                    out[col] = row[alias]
        return out

    def check_row(self, row: dict, where: str) -> dict:
        """Normalize a row's types; `where` ("file line N") goes into every error message."""
        row = dict(row)
        for col in self.columns:
            if col in self.list_columns:
                row[col] = parse_list(row[col], col, where)
            elif row[col] is None:
                raise ValueError(f"{where}: column '{col}' is empty")
            else:
                row[col] = str(row[col])
        return row

    def rows(self, tokenizer, data_dir=None, seed: int = 0, num_samples: int | None = None) -> list[dict]:
        """Rows to draw samples from (cheap: the expensive part is `expand`, done lazily)."""
        return self.load(data_dir)

    # ---- one row -> one sample ------------------------------------------------------------

    def expand(self, row: dict, index: int, tokenizer, seed: int) -> dict:
        """Complete a row before templating (RULER generates, PG-19 splits by tokens)."""
        return row

    def prompt(self, row: dict) -> str:
        return self.template.format(**row)

    def context_end(self, row: dict, prompt: str) -> int | None:
        """Characters of the prompt that are the context, compressed before the question in
        --context_only mode; None when the prompt has no question apart from its context."""
        marker = "{" + self.context_field + "}"
        if marker not in self.template:
            return None
        end = len(self.template[: self.template.index(marker) + len(marker)].format(**row))
        return end if end < len(prompt) else None

    def labels(self, row: dict) -> list[str]:
        return list(row["answers"])

    def options(self, row: dict) -> list[str] | None:
        return None

    def continuation(self, row: dict) -> str | None:
        return None

    def sample_id(self, row: dict, index: int, seed: int) -> str:
        return f"{self.name}-{index}"

    def make_sample(self, row: dict, index: int, tokenizer, seed: int = 0) -> Sample:
        row = self.expand(row, index, tokenizer, seed)
        prompt = self.prompt(row)
        sample = Sample(
            id=self.sample_id(row, index, seed),
            prompt=prompt,
            labels=self.labels(row),
            options=self.options(row),
            answer_index=row.get("label") if self.kind == "multiple_choice" else None,
            continuation=self.continuation(row),
            context_end=self.context_end(row, prompt),
            meta=dict(row.get("meta", {})),
        )
        sample.prompt_tokens = len(tokenizer.encode(prompt))
        extra = 0
        if sample.options:
            extra = max(len(tokenizer.encode(o)) for o in sample.options)
        elif sample.continuation is not None:
            extra = len(tokenizer.encode(sample.continuation))
        sample.total_tokens = sample.prompt_tokens + extra
        return sample

    def samples(
        self,
        tokenizer,
        max_prompt_tokens: int | None = None,
        num_samples: int | None = None,
        seed: int = 0,
        data_dir: str | Path | None = None,
    ) -> list[Sample]:
        """Seeded samples that fit in `max_prompt_tokens` (see `Sample.total_tokens`).

        Rows are visited in a seeded random order and built lazily until `num_samples` fit, so a
        large data set is not tokenized whole; the result is returned in row order.
        """
        if num_samples is not None and (
            isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0
        ):
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r} (omit it for all samples)")
        rows = self.rows(tokenizer, data_dir=data_dir, seed=seed, num_samples=num_samples)
        order = list(range(len(rows)))
        if num_samples is not None:
            random.Random(seed).shuffle(order)
        kept: list[tuple[int, Sample]] = []
        examined = filtered = 0
        for i in order:
            if num_samples is not None and len(kept) == num_samples:
                break
            sample = self.make_sample(rows[i], i, tokenizer, seed)
            examined += 1
            if max_prompt_tokens is not None and sample.total_tokens > max_prompt_tokens:
                filtered += 1
                continue
            kept.append((i, sample))
        limit = "no length limit" if max_prompt_tokens is None else f"longer than {max_prompt_tokens} tokens"
        print(f"{self.name}: filtered {filtered} of {examined} samples ({limit}); kept {len(kept)}")
        return [s for _, s in sorted(kept, key=lambda pair: pair[0])]

    # ---- scoring --------------------------------------------------------------------------

    def postprocess(self, prediction: str) -> str:
        return prediction.strip()

    def score(self, predictions: list, labels: list) -> dict[str, float]:
        """Apply this task's metrics. Predictions: generated text (generate), the chosen option's
        text, `sample.options[pick_option(...)]` (multiple_choice), or per-sample lists of token
        log-probs (perplexity). Labels: `[s.labels for s in samples]`."""
        if len(predictions) != len(labels):
            raise ValueError(f"{self.name}: {len(predictions)} predictions for {len(labels)} labels")
        if self.kind == "generate":
            predictions = [self.postprocess(p) for p in predictions]
        result: dict[str, float] = {}
        for metric in self.metrics:
            values = M.compute(metric, predictions, labels)
            if values:
                result.update(values)
        return result


# ---- local data files -------------------------------------------------------------------------


def find_data_file(data_dir: str | Path, name: str, columns=()) -> Path:
    for ext in FILE_TYPES:
        path = Path(data_dir) / f"{name}{ext}"
        if path.is_file():
            return path
    raise ValueError(
        f"no data file for task '{name}' in {data_dir}: expected {name}.jsonl, {name}.csv or "
        f"{name}.parquet with columns: {', '.join(columns)}"
    )


def read_table(path: str | Path, columns) -> list[tuple[str, dict]]:
    """Rows of a JSONL/CSV/parquet file, each with its location ("file line N") for errors."""
    path = Path(path)
    need = ", ".join(columns)
    if path.suffix == ".jsonl":
        return _read_jsonl(path, columns, need)
    if path.suffix == ".csv":
        return _read_csv(path, columns, need)
    if path.suffix == ".parquet":
        return _read_parquet(path, columns, need)
    raise ValueError(f"{path}: unsupported file type (use .jsonl, .csv or .parquet)")


def _read_jsonl(path, columns, need):
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with columns {need}")
            missing = [c for c in columns if c not in row]
            if missing:
                raise ValueError(f"{where}: missing column(s) {', '.join(missing)} (required: {need})")
            out.append((where, row))
    return out


def _read_csv(path, columns, need):
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long documents live in single fields
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{path}: empty file (expected a header with columns {need})")
            missing = [c for c in columns if c not in header]
            if missing:
                raise ValueError(f"{path} line 1 (header): missing column(s) {', '.join(missing)} (required: {need})")
            for record in reader:
                where = f"{path} line {reader.line_num}"
                if not record:
                    continue
                if len(record) != len(header):
                    raise ValueError(f"{where}: {len(record)} fields, but the header has {len(header)}")
                out.append((where, dict(zip(header, record))))
        except csv.Error as e:
            raise ValueError(f"{path} line {reader.line_num}: malformed CSV ({e})") from None
    return out


def _read_parquet(path, columns, need):
    import pandas as pd

    try:
        frame = pd.read_parquet(path)
    except ImportError:
        raise ValueError(f"{path}: reading parquet needs pyarrow or fastparquet; install one or use JSONL") from None
    except Exception as e:  # any reader error is a bad file
        raise ValueError(f"{path}: unreadable parquet file ({type(e).__name__}: {e})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (required: {need})")
    return [(f"{path} row {i + 1}", row) for i, row in enumerate(frame.to_dict(orient="records"))]


def parse_list(value, col: str, where: str) -> list[str]:
    """A list column: a JSON list (CSV cell or JSONL value), or a single string."""
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: column '{col}' is not a valid JSON list") from None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: column '{col}' must be a non-empty string or list of strings")
    return [str(v) for v in value]
