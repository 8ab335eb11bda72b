"""RepoBench (next-line code completion with cross-file context).

Local files need the columns
    context   the code before the line to complete (cross-file snippets, imports, current file)
    answers   the next line (a string, or a JSON list of acceptable lines)
"""

from __future__ import annotations

from tasks.base import Task


class RepoBench(Task):
    name = "repobench"
    max_new_tokens = 64
    metrics = ("exact_match", "levenshtein")
    columns = ("context", "answers")
    hub = ("tianyang/repobench_python_v1.1", None, "cross_file_first")
    template = "Please complete the code given below.\n{context}\nNext line of code:\n"

    def from_hub(self, row):
        snippets = "\n".join(f"# {c.get('path', '')}\n{c['snippet']}" for c in row.get("context", []))
        code = f"{row.get('import_statement', '')}\n{row['cropped_code']}"
        return {"context": f"{snippets}\n\n{code}", "answers": [row["next_line"]]}

    def postprocess(self, prediction):
        """Only the first non-empty generated line is the completion."""
        lines = [line for line in prediction.splitlines() if line.strip()]
        return lines[0].strip() if lines else ""
