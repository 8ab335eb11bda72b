"""Context-only compression, compress once and ask many, and saved contexts, on the embedded model,
through the commands a user runs: generate.py (--question, --context_only, --save_cache,
--load_cache) and eval.py (--context_only, the rulerniah_shared task, resuming)."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_errors import ModelLoaded, _tripwire, assert_one_line_error, run_main

import eval as eval_cli
import generate

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the special magic number for the blue lighthouse?"
L2_QUARTER = ["--cache_strategy", "l2", "--max_cache_length", "0.25", "--prompt_compression_strategy", "l2"]
SAVED_SETTINGS = [*L2_QUARTER, "--dtype", "float32", "--max_new_tokens", "20", "--question", QUESTION]

pytestmark = pytest.mark.slow


def generate_cli(*argv: str) -> tuple[str, dict]:
    """Runs `python generate.py`; returns the generated text and the printed statistics by name."""
    done = subprocess.run([sys.executable, "generate.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    text, _, report = done.stdout.partition("\nprefill:")
    stats = dict(re.findall(r"(?:^|, )([a-z ]+): ([^,\n]+)", report, flags=re.M))
    stats["prefill"] = report.splitlines()[0].strip()
    return text, stats


@pytest.fixture(scope="module")
def saved_context(smollm2_checkpoint, tmp_path_factory):
    """A context-only run of long_niah.txt that saves its compressed cache: (file, text, statistics)."""
    path = tmp_path_factory.mktemp("saved") / "niah.safetensors"
    text, stats = generate_cli("--prompt", "long_niah.txt", *SAVED_SETTINGS, "--save_cache", str(path))
    return path, text, stats


def test_save_then_load_gives_the_same_answer_and_the_file_holds_the_cache(saved_context):
    path, saved_text, saved_stats = saved_context
    assert "7341" in saved_text  # the needle survives a 25% l2 cache, context-only
    loaded_text, loaded_stats = generate_cli("--load_cache", str(path), *SAVED_SETTINGS)
    assert loaded_text == saved_text
    saved_tokens = int(saved_stats["prefill"].split()[0])
    question_tokens = int(loaded_stats["prefill"].split()[0])  # the loaded run prefills the question alone
    assert f"after a loaded context of {saved_tokens - question_tokens}," in loaded_stats["prefill"]
    assert "loaded" not in saved_stats["prefill"]
    plain_text, _ = generate_cli("--prompt", "long_niah.txt", *SAVED_SETTINGS, "--context_only")
    assert plain_text == saved_text  # saving changes nothing
    cache_mib = float(saved_stats["cache memory"].split()[0])
    assert path.stat().st_size / 2**20 == pytest.approx(cache_mib, rel=0.05)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (["--max_cache_length", "0.5"], "saved with other cache settings; pass: --cache_strategy l2"),
        (["--dtype", "bfloat16"], "was saved in float32; pass --dtype float32"),
        (["--prefill_chunk_size", "64"], None),  # how the question is fed is free on load
    ],
)
def test_a_context_saved_with_other_settings_is_refused_in_one_line(
    saved_context, change, expected, capsys, monkeypatch
):
    path = saved_context[0]
    argv = ["--load_cache", str(path), *SAVED_SETTINGS, *change]
    if expected is None:
        monkeypatch.setattr(generate, "load_model", _tripwire)
        with pytest.raises(ModelLoaded):  # accepted: it went on to load the model
            generate.main(argv)
        return
    assert_one_line_error(*run_main(argv, capsys, monkeypatch), expected)


def test_a_corrupt_or_foreign_saved_context_is_refused_in_one_line(saved_context, tmp_path, capsys, monkeypatch):
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(saved_context[0].read_bytes()[:5000])
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_text("not a cache")
    for path in (truncated, foreign):
        argv = ["--load_cache", str(path), *SAVED_SETTINGS]
        assert_one_line_error(*run_main(argv, capsys, monkeypatch), "is not a saved context or is corrupt")


@pytest.mark.parametrize("mode", [[], ["--context_only"]], ids=["query_aware", "context_only"])
def test_debug_strategy_runs_in_both_modes(mode, smollm2_checkpoint):
    argv = ["--prompt", "long_niah.txt", "--question", QUESTION, "--max_new_tokens", "8", "--dtype", "float32"]
    text, stats = generate_cli(*argv, "--cache_strategy", "debug_heavy_hitter", "--max_cache_length", "0.25",
                               "--prompt_compression_strategy", "heavy_hitter", *mode)  # fmt: skip
    assert text.strip()
    assert 0.7 < float(stats["compression ratio"]) < 0.8
    assert 0 < float(stats["attention loss"].split()[0]) < 1


def eval_shared(out_dir: Path, *extra: str) -> tuple[dict, Path]:
    argv = ["--tasks", "rulerniah_shared", "--seq_length", "1000", "--num_samples", "4", "--max_new_tokens", "16",
            "--dtype", "float32", "--out_dir", str(out_dir), *extra]  # fmt: skip
    result = eval_cli.main(argv)["rulerniah_shared__max_new_tokens=16__seq_length=1000"]
    folders = [p.parent for p in out_dir.rglob("rulerniah_shared__*_predictions.csv")]
    assert len(folders) == 1
    return result, folders[0] / "rulerniah_shared__max_new_tokens=16__seq_length=1000_predictions.csv"


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("strategy", ["l2", "debug_l2"])
def test_eval_asks_every_question_of_one_compressed_context_and_resumes(strategy, smollm2_checkpoint, tmp_path):
    """Context-only eval of rulerniah_shared: the four questions share one haystack; an interrupted
    run that lost two answers redoes only those, and gets what the uninterrupted run got."""
    flags = ["--cache_strategy", strategy, "--max_cache_length", "0.25", "--prompt_compression_strategy", "l2"]
    result, predictions = eval_shared(tmp_path, *flags, "--context_only")
    assert "context_only" in predictions.parent.name
    rows = read_rows(predictions)
    assert [r["id"] for r in rows] == [f"rulerniah_shared-1000-s0-0-q{q}" for q in range(4)]
    assert len({r["prompt"].split("What are all")[0] for r in rows}) == 1  # one context, four questions
    assert result["metrics"]["string_match_all"] > 0  # at least one needle kept through 25% l2
    with open(predictions, "w", newline="", encoding="utf-8") as f:  # as if killed after q0 and q2
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows([rows[0], rows[2]])
    resumed, _ = eval_shared(tmp_path, *flags, "--context_only")
    again = {r["id"]: r["prediction"] for r in read_rows(predictions)}
    assert len(read_rows(predictions)) == 4
    assert again == {r["id"]: r["prediction"] for r in rows}
    assert resumed["metrics"] == result["metrics"]


def test_eval_query_aware_is_the_default_and_named_apart(smollm2_checkpoint, tmp_path):
    result, predictions = eval_shared(tmp_path, *L2_QUARTER)
    assert "context_only" not in predictions.parent.name
    assert len(read_rows(predictions)) == 4 and result["num_samples"] == 4
