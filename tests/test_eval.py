"""Tests of eval.py, score_continuation (generation.py) and scripts/plot_results.py.

Fast tests use a tiny random model or stop before any model loads; `slow` tests run the embedded
SmolLM2-135M-Instruct. The sweep test prints a table of its statistics per strategy and budget.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import plot_results
import pytest
import torch
from helpers import tiny_transformer

import eval as eval_cli
from cache_args import default_cache_kwargs
from generation import load_model, score_continuation, setup_caches
from tasks import pick_option
from tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"


def folder_of(out_dir: Path, **cache_overrides) -> Path:
    return out_dir / MODEL / eval_cli.config_folder_name(default_cache_kwargs(**cache_overrides))


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def full_forward_logprobs(model, ids: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """Log-probs of ids[n_prompt:] from one causal forward pass over all of ids."""
    setup_caches(model, default_cache_kwargs(), ids.numel(), 0)
    logits = model(ids.view(1, -1), torch.arange(ids.numel()), is_prefill=True)[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)[n_prompt - 1 : -1]
    return logprobs.gather(1, ids[n_prompt:].view(-1, 1)).view(-1)


# ---- fast: score_continuation on a tiny random model -----------------------------------------


def test_score_continuation_matches_full_forward_tiny():
    model = tiny_transformer(seed=1)
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(0))
    logprobs, stats = score_continuation(model, ids[:40], ids[40:], default_cache_kwargs())
    reference = full_forward_logprobs(model, ids, 40)
    assert logprobs.shape == (20,)
    torch.testing.assert_close(logprobs, reference, rtol=1e-4, atol=1e-4)
    assert stats["compression_ratio"] == 0.0 and stats["new_tokens"] == 20


def test_score_continuation_compressed_cache_evicts_tiny():
    model = tiny_transformer(seed=1)
    ids = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(0))
    kwargs = default_cache_kwargs(cache_strategy=["recent_global"], max_cache_length=[0.25], recent_window=4)
    logprobs, stats = score_continuation(model, ids[:40], ids[40:], kwargs)
    assert logprobs.shape == (40,) and torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    assert stats["compression_ratio"] == pytest.approx(1 - 24 / 79)  # 20% of 80 -> 24 slots of 79 tokens seen
    with pytest.raises(ValueError):
        score_continuation(model, ids[:40], ids[:0], kwargs)


# ---- fast: names, CSV repair -----------------------------------------------------------------


def test_folder_and_task_names_are_deterministic_and_safe():
    a = eval_cli.config_folder_name(default_cache_kwargs(cache_strategy=["heavy_hitter"], max_cache_length=[0.25]))
    b = eval_cli.config_folder_name(default_cache_kwargs(cache_strategy=["heavy_hitter"], max_cache_length=[0.25]))
    c = eval_cli.config_folder_name(default_cache_kwargs(cache_strategy=["heavy_hitter"], max_cache_length=[0.5]))
    assert a == b != c
    assert a.startswith("heavy_hitter__") and "max_cache_length=0.25" in a
    assert all(ch.isalnum() or ch in "._=+-" for ch in a) and len(a) <= eval_cli.MAX_NAME
    assert eval_cli.config_folder_name(default_cache_kwargs()).startswith("full__")
    args = eval_cli.build_parser().parse_args(["--tasks", "rulerniah", "rulerniah:seq_length=1000"])
    labels = [label for label, _ in eval_cli.resolve_tasks(args)]
    assert labels == ["rulerniah", "rulerniah__seq_length=1000"]


def test_read_predictions_drops_incomplete_last_row(tmp_path):
    path = tmp_path / "t_predictions.csv"
    rows = [
        {c: f"{c}{i}\nwith a newline" if c == "prompt" else f"{c}{i}" for c in eval_cli.CSV_COLUMNS} for i in range(3)
    ]
    eval_cli.write_csv_atomic(path, rows)
    complete = path.read_bytes()
    assert list(eval_cli.read_predictions(path)) == ["id0", "id1", "id2"]
    # A kill can stop a write anywhere: inside the quoted prompt (even right after its newline),
    # inside the last field, or just before the final newline.
    partial = b'id3,"prompt3\nwith', b'id3,"prompt3\n', complete.splitlines(keepends=True)[-1][:-3]
    for tail in partial:
        path.write_bytes(complete + tail)
        assert list(eval_cli.read_predictions(path)) == ["id0", "id1", "id2"]
        assert path.read_bytes() == complete  # repaired in place
    path.write_bytes(complete[:-1])  # the last row lost its newline: rerun it
    assert list(eval_cli.read_predictions(path)) == ["id0", "id1"]
    path.write_bytes(b"id,pro")  # killed while writing the header
    assert eval_cli.read_predictions(path) == {}
    writer = eval_cli.PredictionWriter(path)
    writer.write(rows[0])
    writer.close()
    assert list(eval_cli.read_predictions(path)) == ["id0"]


def test_model_input_puts_answer_prefix_in_assistant_turn(smollm2_checkpoint):
    tokenizer = get_tokenizer(smollm2_checkpoint)
    text = eval_cli.model_input(tokenizer, "Context.\nQuestion: q?\nAnswer: The answer is", "generate", True)
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    assert "Question: q?<|im_end|>" in text
    assert eval_cli.model_input(tokenizer, "Q: q?\nA:", "multiple_choice", True).endswith("assistant\n")
    assert eval_cli.model_input(tokenizer, "book text", "perplexity", True) == "book text"
    assert eval_cli.model_input(tokenizer, "x\nAnswer:", "generate", False) == "x\nAnswer:"


def test_work_units_batch_single_samples_and_keep_shared_contexts_whole():
    def sample(name, group=None):
        return SimpleNamespace(id=name, meta={"group": group} if group else {})

    samples = [sample("a"), sample("b"), sample("c", "g"), sample("d", "g"), sample("e"), sample("f"), sample("h")]
    todo = {"a", "b", "c", "d", "f", "h"}  # e finished before a kill
    units = eval_cli.work_units(samples, todo, shared=True, batch_size=2)
    assert [(group and [s.id for s in group], [s.id for s in waiting]) for group, waiting in units] == [
        (None, ["a", "b"]),
        (["c", "d"], ["c", "d"]),
        (None, ["f", "h"]),
    ]
    query_aware = eval_cli.work_units(samples, todo, shared=False, batch_size=4)
    assert [[s.id for s in waiting] for _, waiting in query_aware] == [["a", "b", "c", "d"], ["f", "h"]]


# ---- fast: bad input fails in one line before the model loads ---------------------------------


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not be loaded for bad input")

    monkeypatch.setattr(eval_cli, "load_model", refuse)


def eval_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(argv)
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("error: "), message
    assert "\n" not in message, message
    capsys.readouterr()
    return message


def test_bad_input_one_line_errors(tmp_path, smollm2_checkpoint, no_model, capsys):
    base = ["--checkpoint_path", str(smollm2_checkpoint), "--out_dir", str(tmp_path / "out")]
    message = eval_error(["--tasks", "nosuchtask", *base], capsys)
    assert "unknown task 'nosuchtask'" in message and "rulerniah" in message
    assert not (tmp_path / "out").exists()  # nothing created for a typo
    assert "no option bogus" in eval_error(["--tasks", "rulerniah:bogus=1", *base], capsys)
    assert "--num_samples" in eval_error(["--tasks", "rulerniah", "--num_samples", "0", *base], capsys)
    assert "--batch_size 0 is too small" in eval_error(["--tasks", "rulerniah", "--batch_size", "0", *base], capsys)
    assert "--seq_length" in eval_error(["--tasks", "truthfulqa", "--seq_length", "500", *base], capsys)
    message = eval_error(
        ["--tasks", "rulerniah", "--cache_strategy", "full", "--max_cache_length", "0.5", *base], capsys
    )
    assert "full cache" in message
    assert "unknown cache strategy" in eval_error(["--tasks", "rulerniah", "--cache_strategy", "nope", *base], capsys)

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    unwritable = ["--checkpoint_path", str(smollm2_checkpoint), "--out_dir", str(blocker / "sub")]
    message = eval_error(["--tasks", "rulerniah", "--seq_length", "200", *unwritable], capsys)
    assert "not writable" in message and str(blocker) in message

    busy = folder_of(tmp_path / "out")
    busy.mkdir(parents=True)
    held = eval_cli.lock(busy / ".rulerniah__seq_length=200.lock", wait=False)  # as another run would
    try:
        message = eval_error(["--tasks", "rulerniah", "--seq_length", "200", "--num_samples", "1", *base], capsys)
        assert "another eval.py is running task 'rulerniah__seq_length=200'" in message
    finally:
        held.close()

    data = tmp_path / "data"
    data.mkdir()
    good = {"question": "Is the sky blue?", "options": ["yes", "no"], "label": 0}
    (data / "truthfulqa.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({"question": "q", "options": ["a"]}))
    message = eval_error(["--tasks", "truthfulqa", "--data_dir", str(data), *base], capsys)
    assert f"{data / 'truthfulqa.jsonl'} line 2" in message and "label" in message
    (data / "truthfulqa.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    message = eval_error(["--tasks", "truthfulqa", "--data_dir", str(data), *base], capsys)
    assert f"{data / 'truthfulqa.jsonl'} line 2" in message and "malformed" in message
    (data / "truthfulqa.jsonl").unlink()
    (data / "truthfulqa.csv").write_text('question,options\nq,"[""a"", ""b""]"\n')
    message = eval_error(["--tasks", "truthfulqa", "--data_dir", str(data), *base], capsys)
    assert "truthfulqa.csv line 1" in message and "label" in message


def test_overwrite_discards_earlier_predictions(tmp_path, smollm2_checkpoint, no_model):
    folder = folder_of(tmp_path)
    folder.mkdir(parents=True)
    stale = [folder / "rulerniah__seq_length=200_predictions.csv", folder / "rulerniah__seq_length=200_metrics.json"]
    other = folder / "rulervt_predictions.csv"
    for path in [*stale, other]:
        path.write_text("stale")
    (folder / "all_metrics.json").write_text(json.dumps({"rulerniah__seq_length=200": {}, "rulervt": {}}))
    argv = ["--tasks", "rulerniah", "--seq_length", "200", "--num_samples", "1", "--overwrite"]
    with pytest.raises(AssertionError, match="must not be loaded"):  # stops where the model would load
        eval_cli.main([*argv, "--checkpoint_path", str(smollm2_checkpoint), "--out_dir", str(tmp_path)])
    assert not any(p.exists() for p in stale) and other.exists()
    assert list(json.loads((folder / "all_metrics.json").read_text())) == ["rulervt"]


def test_bad_input_subprocess_exit(tmp_path, smollm2_checkpoint):
    """The real command line: non-zero exit, one line on stderr, no traceback."""
    cmd = [sys.executable, str(ROOT / "eval.py"), "--tasks", "rulerniah", "--num_samples", "0"]
    cmd += ["--checkpoint_path", str(smollm2_checkpoint), "--out_dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().startswith("error: --num_samples") and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


# ---- slow: the embedded model -----------------------------------------------------------------


@pytest.mark.slow
def test_rulerniah_full_cache_string_match(tmp_path, smollm2_checkpoint):
    # 32 new tokens instead of the task's 128: the number comes first, and SmolLM2 then keeps
    # listing numbers until the limit, so the default would only add decode time.
    argv = ["--tasks", "rulerniah", "--seq_length", "2000", "--num_samples", "10", "--max_new_tokens", "32"]
    results = eval_cli.main([*argv, "--checkpoint_path", str(smollm2_checkpoint), "--out_dir", str(tmp_path)])
    label = "rulerniah__max_new_tokens=32"  # seq_length 2000 is the default
    result = results[label]
    folder = folder_of(tmp_path)
    rows = read_rows(folder / f"{label}_predictions.csv")
    for row in rows:
        print(row["id"], row["labels"], repr(row["prediction"][:60]))
    print("rulerniah @2000, full cache:", result["metrics"])
    assert len(rows) == 10 and result["num_samples"] == 10
    assert result["metrics"]["string_match_all"] >= 0.9
    assert result["statistics"]["compression_ratio"] == 0.0
    assert json.loads((folder / "all_metrics.json").read_text())[label] == result
    assert json.loads((folder / f"{label}_metrics.json").read_text()) == result
    assert json.loads((folder / "args.json").read_text())["tasks"] == ["rulerniah"]


@pytest.mark.slow
def test_perplexity_prefill_decode_equals_full_forward(smollm2_checkpoint):
    model = load_model(smollm2_checkpoint, torch.device("cpu"), torch.float32)
    tokenizer = get_tokenizer(smollm2_checkpoint)
    text = " ".join(p.read_text() for p in sorted((ROOT / "prompts").glob("*.txt")))
    ids = torch.tensor(tokenizer.encode(text)[:264])
    n_prompt = 200
    logprobs, stats = score_continuation(model, ids[:n_prompt], ids[n_prompt:], default_cache_kwargs())
    reference = full_forward_logprobs(model, ids, n_prompt)
    ppl = math.exp(-logprobs.mean().item())
    ppl_reference = math.exp(-reference.mean().item())
    print(f"perplexity prefill+decode {ppl:.6f}, full forward {ppl_reference:.6f}")
    assert abs(ppl - ppl_reference) / ppl_reference < 1e-3
    assert stats["compression_ratio"] == 0.0


@pytest.mark.slow
def test_multiple_choice_picks_highest_loglikelihood(tmp_path, smollm2_checkpoint):
    model = load_model(smollm2_checkpoint, torch.device("cpu"), torch.float32)
    tokenizer = get_tokenizer(smollm2_checkpoint)
    prompt = torch.tensor(tokenizer.encode("The capital of France is"))
    options = [" banana", " Paris", " the moon"]
    lls = []
    for option in options:
        logprobs, _ = score_continuation(
            model, prompt, torch.tensor(tokenizer.encode(option, bos=False)), default_cache_kwargs()
        )
        lls.append(logprobs.sum().item())
    print("log-likelihoods:", dict(zip(options, lls)))
    assert pick_option(lls) == max(range(3), key=lambda i: lls[i]) == 1

    # The same through eval.py (a local TruthfulQA file) and the PG-19 perplexity path.
    data = tmp_path / "data"
    data.mkdir()
    rows = [
        {"question": "What is the capital of France?", "options": ["Banana", "Paris", "The moon"], "label": 1},
        {"question": "What color is the sky on a clear day?", "options": ["Blue", "Green"], "label": 0},
    ]
    (data / "truthfulqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "pg19.jsonl").write_text(json.dumps({"text": text_of_prompts()}) + "\n")
    argv = ["--tasks", "truthfulqa", "pg19:prompt_tokens=48,continuation_tokens=16", "--data_dir", str(data)]
    argv += ["--checkpoint_path", str(smollm2_checkpoint), "--out_dir", str(tmp_path / "out"), "--dtype", "float32"]
    results = eval_cli.main(argv)
    folder = folder_of(tmp_path / "out")
    for row in read_rows(folder / "truthfulqa_predictions.csv"):
        lls = json.loads(row["logprobs"])
        options = [" " + o for o in rows[int(row["id"].rsplit("-", 1)[1])]["options"]]
        assert row["prediction"] == options[pick_option(lls)]
    assert set(results) == {"truthfulqa", "pg19__continuation_tokens=16__prompt_tokens=48"}
    assert 0.0 <= results["truthfulqa"]["metrics"]["accuracy"] <= 1.0
    (pg_row,) = read_rows(folder / "pg19__continuation_tokens=16__prompt_tokens=48_predictions.csv")
    token_logprobs = json.loads(pg_row["logprobs"])
    pooled = math.exp(-sum(token_logprobs) / len(token_logprobs))
    ppl = results["pg19__continuation_tokens=16__prompt_tokens=48"]["metrics"]["perplexity"]
    assert ppl == pytest.approx(pooled, rel=1e-6) and ppl > 1


def text_of_prompts() -> str:
    return " ".join(p.read_text() for p in sorted((ROOT / "prompts").glob("*.txt")))


def count_complete_rows(path: Path) -> int:
    if not path.is_file():
        return 0
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        records = list(csv.reader(text.splitlines(keepends=True)))
    except csv.Error:
        return 0
    body = records[1:] if text.endswith("\n") else records[1:-1]
    return sum(len(r) == len(eval_cli.CSV_COLUMNS) for r in body)


L2_HALF = dict(cache_strategy=["l2"], max_cache_length=[0.5], prompt_compression_strategy=["l2"])


@pytest.mark.slow
def test_kill_and_resume_in_batches(tmp_path, smollm2_checkpoint):
    """A run in batches of 4, killed after its first rows and rerun, writes each sample once, with the
    predictions of an uninterrupted run in batches of 1 (float32: greedy ties break alike)."""

    def command(out_dir, batch_size):
        argv = ["--tasks", "rulerniah", "--seq_length", "500", "--num_samples", "6", "--max_new_tokens", "12"]
        argv += ["--dtype", "float32", "--batch_size", str(batch_size), "--cache_strategy", "l2"]
        argv += ["--max_cache_length", "0.5", "--prompt_compression_strategy", "l2"]
        return [sys.executable, str(ROOT / "eval.py"), *argv, "--checkpoint_path", str(smollm2_checkpoint)] + [
            "--out_dir",
            str(out_dir),
        ]

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    name = "rulerniah__max_new_tokens=12__seq_length=500_predictions.csv"
    reference = subprocess.run(command(tmp_path / "ref", 1), capture_output=True, text=True, timeout=900, env=env)
    assert reference.returncode == 0, reference.stderr[-2000:]
    expected = {r["id"]: r["prediction"] for r in read_rows(folder_of(tmp_path / "ref", **L2_HALF) / name)}
    assert len(expected) == 6

    csv_path = folder_of(tmp_path / "run", **L2_HALF) / name
    proc = subprocess.Popen(command(tmp_path / "run", 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 600
    while count_complete_rows(csv_path) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = count_complete_rows(csv_path)
    assert 2 <= done < 6, f"the run was not killed mid-way ({done} rows)"
    with open(csv_path, "a") as f:  # as if the kill had struck in the middle of writing a row
        f.write('rulerniah-500-s0-5,"<|im_start|>system\nYou are')

    resumed = subprocess.run(command(tmp_path / "run", 4), capture_output=True, text=True, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "dropped an incomplete" in resumed.stdout
    rows = read_rows(csv_path)
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids)) == 6
    assert {r["id"]: r["prediction"] for r in rows} == expected
    metrics = json.loads((csv_path.parent / "all_metrics.json").read_text())
    reference_metrics = json.loads((folder_of(tmp_path / "ref", **L2_HALF) / "all_metrics.json").read_text())
    label = "rulerniah__max_new_tokens=12__seq_length=500"
    assert metrics[label]["metrics"] == reference_metrics[label]["metrics"]
    assert not list(csv_path.parent.glob(".*.tmp"))


SWEEP = [("full", None), ("l2", 0.5), ("l2", 0.25), ("heavy_hitter", 0.25)]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, smollm2_checkpoint):
    """rulerniah @1000 tokens, 2 samples, for each (strategy, budget); the prompt compressor matches
    the strategy (heavy_hitter -> SnapKV), so the strategy decides which prompt tokens are kept."""
    out = tmp_path_factory.mktemp("sweep")
    results = {}
    for strategy, budget in SWEEP:
        argv = ["--tasks", "rulerniah", "--seq_length", "1000", "--num_samples", "2", "--max_new_tokens", "16"]
        argv += ["--checkpoint_path", str(smollm2_checkpoint), "--out_dir", str(out), "--cache_strategy", strategy]
        if budget is not None:
            argv += ["--max_cache_length", str(budget), "--prompt_compression_strategy", strategy]
        results[(strategy, budget or 1.0)] = eval_cli.main(argv)["rulerniah__max_new_tokens=16__seq_length=1000"]
    return out, results


@pytest.mark.slow
def test_sweep_runs_and_plots(sweep, tmp_path, capsys):
    out, results = sweep
    plots = plot_results.main(["--results_dir", str(out / MODEL), "--out_dir", str(tmp_path / "plots")])
    table = capsys.readouterr().out
    with capsys.disabled():
        print("\nstrategy        budget  string_match  compression_ratio  cache_MiB")
        for (strategy, budget), r in results.items():
            stats = r["statistics"]
            print(
                f"{strategy:<15} {budget:<7g} {r['metrics']['string_match_all']:<13.2f} "
                f"{stats['compression_ratio']:<18.3f} {stats['cache_memory_bytes'] / 2**20:.1f}"
            )
    names = {p.name for p in plots}
    label = "rulerniah__max_new_tokens=16__seq_length=1000"
    assert {f"{label}__string_match_all.png", f"{label}__compression_ratio.png", f"{label}__cache_memory.png"} <= names
    assert all(p.stat().st_size > 10_000 for p in plots)
    assert len(read_rows(tmp_path / "plots" / "summary.csv")) == len(SWEEP)
    assert "heavy_hitter (prompt: heavy_hitter)" in table
    assert results[("full", 1.0)]["statistics"]["compression_ratio"] == 0.0
    for (strategy, budget), r in results.items():
        if strategy != "full":  # about 1 - budget of the tokens seen are evicted
            assert r["statistics"]["compression_ratio"] == pytest.approx(1 - budget, abs=0.08)
            full_memory = results[("full", 1.0)]["statistics"]["cache_memory_bytes"]
            assert r["statistics"]["cache_memory_bytes"] < full_memory
