"""Metrics. Each per-sample metric compares one prediction with its list of acceptable answers
(taking the best match); `compute` averages over samples. All scores are in [0, 1] except
perplexity. Optional metrics (BERTScore, LLM-judged ROUGE) return None with a one-line note
when their package / API key is missing, so an offline run never crashes on them.
"""

from __future__ import annotations

import json
import math
import os
import re
import string
import urllib.request

import Levenshtein

_NOTES: set[str] = set()


def note(message: str) -> None:
    """Print a note once per process (not once per sample)."""
    if message not in _NOTES:
        _NOTES.add(message)
        print(f"note: {message}")


def _as_list(labels) -> list[str]:
    return [labels] if isinstance(labels, str) else [str(x) for x in labels]


# ---- per-sample metrics --------------------------------------------------------------------


def string_match_all(prediction: str, labels) -> float:
    """RULER: fraction of the labels that appear in the prediction (case-insensitive)."""
    refs = _as_list(labels)
    pred = prediction.lower()
    return sum(r.lower() in pred for r in refs) / len(refs)


def string_match_part(prediction: str, labels) -> float:
    """RULER: 1 if any label appears in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return float(any(r.lower() in pred for r in _as_list(labels)))


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, labels) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(r) for r in _as_list(labels)))


def levenshtein_similarity(prediction: str, labels) -> float:
    """Normalized edit similarity (1 = identical), best over the labels."""
    return max(Levenshtein.ratio(prediction.strip(), r.strip()) for r in _as_list(labels))


_ROUGE = None


def rouge(prediction: str, labels) -> dict[str, float]:
    """ROUGE-1/2/L F-measure (with stemming), best over the labels."""
    global _ROUGE
    if _ROUGE is None:
        from rouge_score import rouge_scorer

        _ROUGE = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    scores = _ROUGE.score_multi(_as_list(labels), prediction)
    return {name: s.fmeasure for name, s in scores.items()}


def accuracy(prediction, labels) -> float:
    """1 if the chosen option (text or index) is one of the labels."""
    return float(str(prediction).strip() in [str(x).strip() for x in _as_list(labels)])


def perplexity(logprobs) -> float:
    """exp of the mean negative log-likelihood of natural-log token probabilities."""
    logprobs = list(logprobs)
    if not logprobs:
        raise ValueError("perplexity needs at least one token log-prob")
    return math.exp(-sum(logprobs) / len(logprobs))


# ---- optional metrics ----------------------------------------------------------------------


def bertscore(predictions: list[str], labels: list) -> float | None:
    """Mean BERTScore F1, or None when bert_score (or its model) is unavailable."""
    try:
        from bert_score import score as bert_score_fn
    except ImportError:
        note("BERTScore skipped: the bert_score package is not installed")
        return None
    try:
        _, _, f1 = bert_score_fn(list(predictions), [_as_list(x) for x in labels], lang="en", verbose=False)
    except Exception as e:  # typically: its model cannot be downloaded offline
        note(f"BERTScore skipped: {type(e).__name__} while scoring")
        return None
    return float(f1.mean())


LLM_ROUGE_PROMPT = (
    "You compare a candidate answer with reference answers. Estimate the fraction (0 to 1) of the "
    "key information in the best-matching reference that the candidate conveys (recall, judged on "
    "meaning rather than wording). Reply with only the number.\n\n"
    "References:\n{references}\n\nCandidate:\n{prediction}\n"
)


def llm_rouge(predictions: list[str], labels: list) -> float | None:
    """LLM-judged ROUGE (semantic recall) via the OpenAI API; None without OPENAI_API_KEY."""
    key = os.environ.get("OPENAI_API_KEY")
    if not key:
        note("LLM-judged ROUGE skipped: OPENAI_API_KEY is not set")
        return None
    model = os.environ.get("LLM_JUDGE_MODEL", "gpt-4o-mini")
    url = os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1").rstrip("/") + "/chat/completions"
    scores = []
    for pred, refs in zip(predictions, labels):
        content = LLM_ROUGE_PROMPT.format(references="\n".join(f"- {r}" for r in _as_list(refs)), prediction=pred)
        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "temperature": 0,
            }
        )
        request = urllib.request.Request(
            url,
            data=body.encode(),
            headers={
                "Authorization": f"Bearer {key}",
                "Content-Type": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                reply = json.load(response)["choices"][0]["message"]["content"]
            match = re.search(r"\d*\.?\d+", reply)
            scores.append(min(1.0, max(0.0, float(match.group()))) if match else 0.0)
        except Exception as e:  # never echo the request (it carries the key)
            note(f"LLM-judged ROUGE skipped: the API call failed ({type(e).__name__})")
            return None
    return sum(scores) / len(scores) if scores else None


# ---- dispatch ------------------------------------------------------------------------------

PER_SAMPLE = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "exact_match": exact_match,
    "levenshtein": levenshtein_similarity,
    "accuracy": accuracy,
}
METRICS = (*PER_SAMPLE, "rouge", "perplexity", "bertscore", "llm_rouge")


def compute(metric: str, predictions: list, labels: list) -> dict[str, float] | None:
    """Average `metric` over samples. Returns {name: value} (ROUGE gives rouge1/rouge2/rougeL),
    or None for a skipped optional metric or no samples."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric '{metric}'; choose from: {', '.join(METRICS)}")
    if not predictions:
        return None
    if metric in PER_SAMPLE:
        fn = PER_SAMPLE[metric]
        return {metric: sum(fn(p, y) for p, y in zip(predictions, labels)) / len(predictions)}
    if metric == "rouge":
        per = [rouge(p, y) for p, y in zip(predictions, labels)]
        return {k: sum(d[k] for d in per) / len(per) for k in per[0]}
    if metric == "perplexity":  # corpus-level: pool every token of every sample
        return {"perplexity": perplexity([lp for sample in predictions for lp in sample])}
    value = bertscore(predictions, labels) if metric == "bertscore" else llm_rouge(predictions, labels)
    return None if value is None else {metric: value}
