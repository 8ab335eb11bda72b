"""Multiple-choice tasks (QuALITY, TruthfulQA), scored by log-likelihood: eval.py computes the
log-likelihood of each `Sample.options[i]` as a continuation of `Sample.prompt` and picks the
best with `pick_option`.

Local files need the columns
    quality:     context (the story), question, options (JSON list of strings), label (0-based
                 index of the correct option)
    truthfulqa:  question, options, label
"""

from __future__ import annotations

import random

from tasks.base import Task


def pick_option(option_logprobs: list[float]) -> int:
    """Index of the most likely option (the first one on ties)."""
    if not option_logprobs:
        raise ValueError("pick_option needs at least one option log-likelihood")
    return max(range(len(option_logprobs)), key=lambda i: option_logprobs[i])


class MultipleChoiceTask(Task):
    kind = "multiple_choice"
    max_new_tokens = 0
    metrics = ("accuracy",)
    list_columns = ("options",)

    def check_row(self, row, where):
        row = super().check_row(row, where)
        if len(row["options"]) < 2:
            raise ValueError(f"{where}: column 'options' needs at least 2 options")
        label = row["label"]
        try:
            label = int(label)
            if str(row["label"]).strip() != str(label) or not 0 <= label < len(row["options"]):
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: column 'label' must be an option index 0..{len(row['options']) - 1}, got {row['label']!r}"
            ) from None
        row["label"] = label
        return row

    def options(self, row):
        """The exact strings to score after the prompt (a leading space, as after 'Answer:')."""
        return [" " + o.strip() for o in row["options"]]

    def labels(self, row):
        return [row["options"][row["label"]].strip()]


class QuALITY(MultipleChoiceTask):
    name = "quality"
    columns = ("context", "question", "options", "label")
    hub = ("emozilla/quality", None, "validation")
    template = "Read the following story and answer the question.\n\n{context}\n\nQuestion: {question}\nAnswer:"

    def from_hub(self, row):
        return {
            "context": row["article"],
            "question": row["question"],
            "options": row["options"],
            "label": row["answer"],
        }


class TruthfulQA(MultipleChoiceTask):
    name = "truthfulqa"
    columns = ("question", "options", "label")
    hub = ("truthful_qa", "multiple_choice", "validation")
    template = "Q: {question}\nA:"

    def from_hub(self, row):
        # MC1: exactly one true choice, listed first on the hub; shuffle it (seeded by the question).
        choices, marks = row["mc1_targets"]["choices"], row["mc1_targets"]["labels"]
        order = list(range(len(choices)))
        random.Random(row["question"]).shuffle(order)
        return {
            "question": row["question"],
            "options": [choices[i] for i in order],
            "label": [marks[i] for i in order].index(1),
        }


MULTIPLE_CHOICE_TASKS = [QuALITY, TruthfulQA]
