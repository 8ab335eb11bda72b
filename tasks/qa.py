"""Question answering over long documents: RULER QA, MuSiQue, TriviaQA.

Local files (`<data_dir>/<task>.jsonl|.csv|.parquet`) need the columns
    context   the document(s) the answer is in
    question  the question
    answers   acceptable answers: a JSON list of strings (or one plain string)
"""

from __future__ import annotations

import random
from typing import ClassVar

from tasks.base import Task
from tasks.ruler import fit_units


class QATask(Task):
    max_new_tokens = 32
    metrics = ("string_match_part", "exact_match", "rouge")
    columns = ("context", "question", "answers")
    template = (
        "Answer the question based on the given passages. Only give me the answer and do not output "
        "any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based "
        "on the given passages. Only give me the answer and do not output any other words.\n\n"
        "Question: {question}\nAnswer:"
    )


class RulerQA(QATask):
    """RULER QA: the gold paragraph hidden among distractor paragraphs (the other rows' contexts)
    until the prompt has about `seq_length` tokens (None: the gold paragraph alone)."""

    name = "rulerqa"
    metrics = ("string_match_part",)
    hub = ("rajpurkar/squad", None, "validation")
    option_defaults: ClassVar[dict] = {"seq_length": 2000}
    template = (
        "Answer the question based on the given documents. Only give me the answer and do not output "
        "any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based "
        "on the given documents. Only give me the answer and do not output any other words.\n\n"
        "Question: {question}\nAnswer:"
    )
    _pool: tuple[str, ...] = ()  # every row's context, set by rows()

    def from_hub(self, row):
        return {
            "context": row["context"],
            "question": row["question"],
            "answers": list(row["answers"]["text"]),
        }

    def rows(self, tokenizer, data_dir=None, seed=0, num_samples=None):
        rows = self.load(data_dir)
        self._pool = list(dict.fromkeys(r["context"] for r in rows))  # unique paragraphs, file order
        return rows

    def expand(self, row, index, tokenizer, seed):
        rng = random.Random(f"{self.name}|{self.seq_length}|{seed}|{index}")
        distractors = [p for p in self._pool if p != row["context"]]
        rng.shuffle(distractors)
        gold_at = rng.random()

        def build(n):
            docs = distractors[:n]
            docs.insert(round(gold_at * n), row["context"])
            return "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))

        n = 0
        if self.seq_length:

            def count(text):
                return len(tokenizer.encode(text))

            try:
                n, _ = fit_units(
                    lambda k: self.prompt({**row, "context": build(k)}),
                    count,
                    self.seq_length,
                    len(distractors),
                )
            except ValueError:  # the gold paragraph alone is too long: keep it, filtering decides
                n = 0
        return {
            **row,
            "context": build(n),
            "meta": {"distractors": n, "seq_length": self.seq_length},
        }

    def sample_id(self, row, index, seed):
        return f"{self.name}-{self.seq_length}-s{seed}-{index}" if self.seq_length else f"{self.name}-{index}"


class MuSiQue(QATask):
    name = "musique"
    hub = ("dgslibisey/MuSiQue", None, "validation")

    def from_hub(self, row):
        passages = [f"Passage {i + 1}: {p['title']}\n{p['paragraph_text']}" for i, p in enumerate(row["paragraphs"])]
        return {
            "context": "\n\n".join(passages),
            "question": row["question"],
            "answers": [row["answer"], *row.get("answer_aliases", [])],
        }


class TriviaQA(QATask):
    name = "triviaqa"
    hub = ("mandarjoshi/trivia_qa", "rc.wikipedia", "validation")
    template = (
        "Answer the question based on the following text. Only give me the answer and do not output "
        "any other words.\n\n{context}\n\nQuestion: {question}\nAnswer:"
    )

    def from_hub(self, row):
        answer = row["answer"]
        return {
            "context": "\n\n".join(row["entity_pages"]["wiki_context"]),
            "question": row["question"],
            "answers": [answer["value"], *answer.get("aliases", [])],
        }


QA_TASKS = [RulerQA, MuSiQue, TriviaQA]
