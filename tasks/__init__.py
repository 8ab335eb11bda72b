"""Evaluation tasks for eval.py: a registry by name, one module per task family.

    task = get_task("rulerniah", seq_length=4000)
    samples = task.samples(tokenizer, max_prompt_tokens=8000, num_samples=50, seed=0, data_dir=None)
    ... generate a prediction for each sample.prompt (task.max_new_tokens) ...
    metrics = task.score(predictions, [s.labels for s in samples])

See tasks/README.md for the kinds of task, the sample fields and the data-file columns.
"""

from __future__ import annotations

from tasks.base import Sample, Task
from tasks.code import RepoBench
from tasks.multiple_choice import MULTIPLE_CHOICE_TASKS, pick_option
from tasks.pg19 import PG19
from tasks.qa import QA_TASKS
from tasks.ruler import RULER_TASKS
from tasks.summarization import SUMMARIZATION_TASKS

TASK_REGISTRY: dict[str, type[Task]] = {
    cls.name: cls
    for cls in [
        *RULER_TASKS,
        *QA_TASKS,
        *SUMMARIZATION_TASKS,
        *MULTIPLE_CHOICE_TASKS,
        RepoBench,
        PG19,
    ]
}


def list_tasks() -> list[str]:
    return sorted(TASK_REGISTRY)


def get_task(name: str, **options) -> Task:
    """A task instance; `options` are the task's own (e.g. seq_length for RULER)."""
    if name not in TASK_REGISTRY:
        raise ValueError(f"unknown task '{name}'; choose from: {', '.join(list_tasks())}")
    return TASK_REGISTRY[name](**options)


__all__ = ["TASK_REGISTRY", "Sample", "Task", "get_task", "list_tasks", "pick_option"]
