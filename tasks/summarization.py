"""Long-document summarization / query-focused writing: SQuALITY, QMSum, Dolomites.

Local files need the columns
    squality, qmsum:  context (story / meeting transcript), question (query), answers (reference
                      summaries: a JSON list of strings, or one string)
    dolomites:        instruction (the task description), input (the task's input), answers
"""

from __future__ import annotations

from tasks.base import Task


class SummarizationTask(Task):
    max_new_tokens = 256
    metrics = ("rouge", "bertscore", "llm_rouge")
    columns = ("context", "question", "answers")


class SQuALITY(SummarizationTask):
    name = "squality"
    hub = ("pszemraj/SQuALITY-v1.3", None, "validation")
    template = (
        "You are given a story and a question. Answer the question in a paragraph.\n\n"
        "Story:\n{context}\n\nQuestion: {question}\n\nAnswer:"
    )


class QMSum(SummarizationTask):
    name = "qmsum"
    hub = ("pszemraj/qmsum-cleaned", None, "validation")
    template = (
        "You are given a meeting transcript and a query containing a question or instruction. "
        "Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\n"
        "Query: {question}\n\nAnswer:"
    )


class Dolomites(SummarizationTask):
    """Methodical writing tasks by domain experts (task description + input -> structured text)."""

    name = "dolomites"
    columns = ("instruction", "input", "answers")
    hub = ("fcdl/dolomites", None, "test")
    template = "{instruction}\n\nInput:\n{input}\n\nOutput:"
    context_field = "input"

    def from_hub(self, row):
        out = dict(row)
        if "instruction" not in row:
            parts = [row.get(k) for k in ("objective", "procedure") if row.get(k)]
            out["instruction"] = "\n\n".join(map(str, parts))
        out.setdefault("input", row.get("example_input", ""))
        out.setdefault("answers", row.get("example_output", row.get("output")))
        return out


SUMMARIZATION_TASKS = [SQuALITY, QMSum, Dolomites]
