"""PG-19 language modelling: perplexity of a book's continuation, teacher-forced after a prompt.

Local files need the column
    text   the book
The first `prompt_tokens` tokens become the prompt, the next `continuation_tokens` the
continuation whose token log-probs eval.py collects (`score` takes one list per sample).
"""

from __future__ import annotations

from typing import ClassVar

from tasks.base import Task


class PG19(Task):
    name = "pg19"
    kind = "perplexity"
    max_new_tokens = 0
    metrics = ("perplexity",)
    columns = ("text",)
    list_columns = ()
    hub = ("emozilla/pg19", None, "test")
    option_defaults: ClassVar[dict] = {
        "prompt_tokens": 2000,
        "continuation_tokens": 500,
    }

    def __init__(self, **options):
        super().__init__(**options)
        for key in self.option_defaults:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"task '{self.name}': {key} must be a positive integer, got {value!r}")

    def expand(self, row, index, tokenizer, seed):
        want = self.prompt_tokens + self.continuation_tokens
        ids = tokenizer.encode(row["text"][: want * 12])  # no need to tokenize the whole book
        if len(ids) < want:
            ids = tokenizer.encode(row["text"])
        if len(ids) < 2:
            raise ValueError(f"{self.name} row {index}: text has fewer than 2 tokens")
        split = min(self.prompt_tokens, len(ids) * self.prompt_tokens // want)
        split = max(1, min(split, len(ids) - 1))
        return {
            **row,
            "prompt": tokenizer.decode(ids[:split]),
            "continuation": tokenizer.decode(ids[split:want]),
            "meta": {
                "prompt_tokens": split,
                "continuation_tokens": len(ids[split:want]),
            },
        }

    def prompt(self, row):
        return row["prompt"]

    def context_end(self, row, prompt):
        return None  # book text: all context

    def continuation(self, row):
        return row["continuation"]

    def labels(self, row):
        return [row["continuation"]]
