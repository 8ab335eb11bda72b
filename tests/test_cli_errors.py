"""Bad input to generate.py: each is one line on stderr starting with "error:", a non-zero exit, no
traceback, and (except a corrupt checkpoint, which can only be found by reading it) no model load.

Most cases call `generate.main(argv)` in-process with `load_model` replaced by a tripwire, which is
fast and proves the error comes before the weights are read; a few run `python generate.py` in real
subprocesses to check the command line end to end (exit status, stderr, no traceback).
"""

import argparse
import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import generate
from generation import DEFAULT_CHECKPOINT

ROOT = generate.PROMPT_DIR.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ModelLoaded(Exception):
    pass


def _tripwire(*args, **kwargs):
    raise ModelLoaded("load_model was called: the error must come before the model loads")


def run_main(argv, capsys, monkeypatch, allow_load=False):
    """Runs generate.main(argv); returns (exit status, stderr) of the SystemExit it must raise."""
    if not allow_load:
        monkeypatch.setattr(generate, "load_model", _tripwire)
    with pytest.raises(SystemExit) as exc:
        generate.main(argv)
    code = exc.value.code
    err = capsys.readouterr().err
    if isinstance(code, str):  # sys.exit("message"): the interpreter prints it to stderr, status 1
        err, code = err + code + "\n", 1
    return code, err


def assert_one_line_error(code, err, expected):
    assert code not in (0, None), f"exit status {code!r}"
    assert "Traceback" not in err
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert lines[0].startswith("error:"), lines[0]
    assert expected in lines[0], f"{expected!r} not in {lines[0]!r}"


@pytest.fixture
def malformed_yaml(tmp_path):
    path = tmp_path / "malformed.yaml"
    path.write_text("cache_strategy: [heavy_hitter\nglobal_tokens: : 4\n")
    return path


@pytest.fixture
def unknown_key_yaml(tmp_path):
    path = tmp_path / "unknown_key.yaml"
    path.write_text("cache_strategy: [l2]\nlearning_rate: 0.1\n")
    return path


CACHE_CASES = {
    "unknown_strategy": (["--cache_strategy", "nope"], "unknown cache strategy 'nope'"),
    "unknown_compressor": (["--prompt_compression_strategy", "nope"], "unknown prompt compression strategy 'nope'"),
    "full_below_one": (["--cache_strategy", "full", "--max_cache_length", "0.5"], "full cache"),
    "full_absolute": (["--cache_strategy", "full", "--max_cache_length", "64"], "full cache"),
    "full_pyramid": (["--cache_strategy", "full", "--cache_length_pattern", "pyramid"], "full cache"),
    "global_exceeds_cache": (
        ["--max_cache_length", "16", "--global_tokens", "32", "--cache_strategy", "recent_global"],
        "--global_tokens 32 exceeds a cache of 16 slots",
    ),
    "head_specific_compressor": (
        ["--cache_strategy", "recent_global", "--prompt_compression_strategy", "l2"],
        "keeps different tokens per head",
    ),
    "cache_bits_3": (["--cache_bits", "3"], "--cache_bits 3 is not valid; choose from: 2, 4, 8"),
    "debug_full_below_one": (["--cache_strategy", "debug_full", "--max_cache_length", "0.5"], "spans the whole"),
    "debug_hybrid_below_one": (["--cache_strategy", "debug_hybrid", "--max_cache_length", "0.5"], "spans the whole"),
    "negative_global_tokens": (["--global_tokens", "-1"], "--global_tokens -1 is too small; give at least 0"),
    "negative_recent_window": (["--recent_window", "-3"], "--recent_window -3.0 is too small; give at least 0"),
    "history_window_zero": (["--history_window_size", "0"], "--history_window_size 0 is too small; give at least 1"),
    "recovery_above_one": (["--min_recovery_frac", "1.5"], "--min_recovery_frac 1.5 is too large; give at most 1"),
    "attn_top_k_zero": (["--attn_top_k", "0"], "--attn_top_k 0.0 is too small; give more than 0"),
    "fractional_token_count": (["--max_cache_length", "1.5"], "--max_cache_length 1.5 is above 1, so a token count"),
    "non_positive_length": (["--max_cache_length", "0"], "--max_cache_length 0.0 is too small; give more than 0"),
    "unknown_hybrid_policy": (["--cache_strategy", "hybrid", "--hybrid_strategies", "nope"], "unknown hybrid policy"),
    "lengths_not_dividing_layers": (
        ["--cache_strategy", "l2", "--max_cache_length", "0.5", "0.5", "0.5", "0.5"],
        "do not divide the 30 layers",
    ),
    "strategies_not_dividing_layers": (
        ["--cache_strategy", "l2", "random", "keep_it_odd", "recent_global"],
        "do not divide the 30 layers",
    ),
    "unknown_head_budgets": (["--head_budgets", "greedy"], "--head_budgets greedy is not valid; choose from"),
    "adaptive_head_budgets_head_constant": (
        ["--cache_strategy", "tova", "--prompt_compression_strategy", "tova", "--head_budgets", "adaptive"],
        "scores all heads alike",
    ),
    "adaptive_head_budgets_token_by_token": (
        ["--cache_config", "l2", "--head_budgets", "adaptive", "--prefill_chunk_size", "1"],
        "--head_budgets adaptive shares a compressed prompt",
    ),
    "missing_preset": (["--cache_config", "nope"], "cache config 'nope' not found"),
    "preset_name_escaping_cache_configs": (["--cache_config", "../pyproject"], "outside"),
}


@pytest.mark.parametrize("argv,expected", CACHE_CASES.values(), ids=CACHE_CASES.keys())
def test_bad_cache_arguments(argv, expected, capsys, monkeypatch):
    assert_one_line_error(*run_main(argv, capsys, monkeypatch), expected)


def test_malformed_preset(malformed_yaml, capsys, monkeypatch):
    code, err = run_main(["--cache_config", str(malformed_yaml)], capsys, monkeypatch)
    assert_one_line_error(code, err, "is not valid YAML")


def test_preset_with_unknown_key(unknown_key_yaml, capsys, monkeypatch):
    code, err = run_main(["--cache_config", str(unknown_key_yaml)], capsys, monkeypatch)
    assert_one_line_error(code, err, "'learning_rate' is not a cache argument")


def test_preset_with_bad_values_is_checked(tmp_path, capsys, monkeypatch):
    path = tmp_path / "bad_values.yaml"
    path.write_text("cache_strategy: heavy_hitter\nprompt_compression_strategy: nope\n")
    code, err = run_main(["--cache_config", str(path)], capsys, monkeypatch)
    assert_one_line_error(code, err, "unknown prompt compression strategy 'nope'")


@pytest.fixture
def truncated_checkpoint(tmp_path):
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(DEFAULT_CHECKPOINT / name, folder / name)
    with (DEFAULT_CHECKPOINT / "model.pth").open("rb") as f:
        (folder / "model.pth").write_bytes(f.read(1 << 20))
    return folder


@pytest.fixture
def unknown_model_checkpoint(tmp_path):
    """Weights and tokenizer but no config.json, in a folder whose name matches no known config."""
    folder = tmp_path / "mystery-model-7b"
    folder.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_CHECKPOINT / name, folder / name)
    (folder / "model.pth").write_bytes(b"not loaded")
    return folder


def test_missing_checkpoint_names_prepare(tmp_path, capsys, monkeypatch):
    argv = ["--checkpoint_path", str(tmp_path / "SmolLM2-135M-Instruct")]
    assert_one_line_error(*run_main(argv, capsys, monkeypatch), "prepare")


def test_truncated_checkpoint(truncated_checkpoint, capsys, monkeypatch):
    argv = ["--checkpoint_path", str(truncated_checkpoint), "--device", "cpu"]
    assert_one_line_error(*run_main(argv, capsys, monkeypatch, allow_load=True), "corrupt or truncated")


def test_config_name_matching_no_model(unknown_model_checkpoint, capsys, monkeypatch):
    argv = ["--checkpoint_path", str(unknown_model_checkpoint)]
    assert_one_line_error(*run_main(argv, capsys, monkeypatch), "no model config matches 'mystery-model-7b'")


INPUT_CASES = {
    "empty_prompt": (["--prompt", ""], "the prompt is empty"),
    "blank_prompt": (["--prompt", "  \n "], "the prompt is empty"),
    "missing_prompt_file": (["--prompt", "nope.txt"], "prompt file 'nope.txt' not found"),
    "prompt_longer_than_context": (["--max_new_tokens", "9000"], "exceeds the model's context of 8192"),
    "device": (["--device", "nonsense"], "device 'nonsense'"),
    "dtype": (["--dtype", "nonsense"], "unknown dtype 'nonsense'"),
    "max_new_tokens_zero": (["--max_new_tokens", "0"], "--max_new_tokens 0 is too small; give at least 1"),
    "negative_temperature": (["--temperature", "-1"], "--temperature -1.0 is too small; give at least 0"),
    "negative_top_k": (["--top_k", "-2"], "--top_k -2 is too small; give at least 1"),
    "unwritable_profile": (["--profile", "/proc/no/trace.json"], "cannot write --profile /proc/no/trace.json"),
    "unwritable_csv": (["--csv", "/proc/no/runs.csv"], "cannot write --csv /proc/no/runs.csv"),
    "csv_is_a_folder": (["--csv", "/tmp"], "--csv /tmp is a folder"),
    "chunk_zero": (["--prefill_chunk_size", "0"], "--prefill_chunk_size 0 is too small; give at least 1"),
    "chunk_negative": (["--prefill_chunk_size", "-4"], "--prefill_chunk_size -4 is too small; give at least 1"),
    "context_only_without_question": (["--context_only"], "--context_only needs --question"),
    "empty_question": (["--question", " "], "the question is empty"),
    "save_without_question": (["--save_cache", "/tmp/c.safetensors"], "--save_cache needs --question"),
    "save_and_load": (["--question", "Q?", "--save_cache", "a", "--load_cache", "b"], "exclude each other"),
    "load_with_prompt": (["--question", "Q?", "--load_cache", "a", "--prompt", "x"], "--load_cache takes no --prompt"),
    "load_missing": (["--question", "Q?", "--load_cache", "/nonexistent/c.safetensors"], "not found"),
    "save_unwritable": (["--question", "Q?", "--save_cache", "/proc/no/c.safetensors"], "cannot write --save_cache"),
    "question_leaves_no_room": (
        ["--question", "Q? " * 40, "--context_only", "--cache_strategy", "l2", "--max_cache_length", "16"],
        "leaves no room for the context",
    ),
}


@pytest.mark.parametrize("argv,expected", INPUT_CASES.values(), ids=INPUT_CASES.keys())
def test_bad_inputs(argv, expected, capsys, monkeypatch):
    assert_one_line_error(*run_main(argv, capsys, monkeypatch), expected)


PROMPTS_FILE_CASES = {  # (file name, its text or None for no file, more flags, expected)
    "batch_size_zero": ("p.txt", "hello\n", ["--batch_size", "0"], "--batch_size 0 is too small; give at least 1"),
    "missing": ("p.txt", None, [], "not found; pass a file with one prompt per line"),
    "empty": ("p.txt", "\n  \n", [], "holds no prompt"),
    "jsonl_without_prompt": (
        "p.jsonl",
        '{"prompt": "hi"}\n{"text": "hi"}\n',
        [],
        'line 2 is not a JSON object with a "prompt"',
    ),
    "jsonl_not_json": ("p.jsonl", "hello\n", [], 'line 1 is not a JSON object with a "prompt"'),
    "with_prompt": ("p.txt", "hello\n", ["--prompt", "hi"], "--prompts_file and --prompt exclude each other"),
    "with_question": ("p.txt", "hello\n", ["--question", "Q?"], "drop --question"),
    "too_long": ("p.txt", "hello\nhi\n", ["--max_new_tokens", "8190"], "prompt 1 of"),
}


@pytest.mark.parametrize("name,text,flags,expected", PROMPTS_FILE_CASES.values(), ids=PROMPTS_FILE_CASES.keys())
def test_bad_prompts_files(name, text, flags, expected, tmp_path, capsys, monkeypatch):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert_one_line_error(*run_main(["--prompts_file", str(path), *flags], capsys, monkeypatch), expected)


@pytest.mark.parametrize(("flag", "what"), [("--prompts_file", "prompts file"), ("--prompt", "prompt file")])
def test_an_unreadable_prompt_file_is_one_line(flag, what, tmp_path, capsys, monkeypatch):
    path = tmp_path / "p.txt"
    path.write_text("hello\n")
    read_text = Path.read_text

    def refuse_path(self, *args, **kwargs):  # chmod 000 does not stop root, who runs CI
        if self == path:
            raise PermissionError(13, "Permission denied")
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse_path)
    expected = f"cannot read {what} {path} (Permission denied)"
    assert_one_line_error(*run_main([flag, str(path)], capsys, monkeypatch), expected)


def test_batch_size_needs_a_prompts_file(capsys, monkeypatch):
    assert_one_line_error(*run_main(["--batch_size", "4"], capsys, monkeypatch), "--batch_size needs --prompts_file")


def test_command_line_end_to_end(malformed_yaml, tmp_path):
    """Real `python generate.py` processes (run concurrently): exit status, one stderr line, no traceback."""
    cases = [  # one per exit path: parser.exit (presets) and sys.exit (everything else)
        (["--cache_config", str(malformed_yaml)], "is not valid YAML"),
        (["--checkpoint_path", str(tmp_path / "missing"), "--cache_strategy", "nope"], "prepare"),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "generate.py", *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for argv, _ in cases
    ]
    for proc, (_, expected) in zip(procs, cases):
        out, err = proc.communicate(timeout=120)
        assert out == ""
        assert_one_line_error(proc.returncode, err, expected)


def test_csv_rows_of_other_columns_never_lose_what_the_file_holds(tmp_path):
    """A row with a new column widens the header and keeps every earlier line as it was (even one
    longer than its header, as an older version wrote); the file's mode and a link to it stay; rows
    appended by runs at once, some of them widening the header, are all there."""
    target = tmp_path / "runs.csv"
    target.write_text("x,y\n1,2\n1,5,6\n")
    target.chmod(0o664)
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    generate.append_csv(link, {"x": 7, "z": 8}, argparse.Namespace())
    assert link.is_symlink() and target.stat().st_mode & 0o777 == 0o664
    assert target.read_text().splitlines() == ["x,y,z", "1,2", "1,5,6", "7,,8"]
    generate.append_csv(link, {"z": 9}, argparse.Namespace())
    assert target.read_text().splitlines()[-1] == ",,9"
    script = (
        "import argparse, sys; sys.path.insert(0, sys.argv[1]); import generate\n"
        "for i in range(40):\n"
        "    generate.append_csv(generate.Path(sys.argv[2]), {'who': sys.argv[3], f'c{sys.argv[3]}{i % 3}': i},"
        " argparse.Namespace())\n"
    )
    shared = tmp_path / "shared.csv"
    runs = [subprocess.Popen([sys.executable, "-c", script, str(ROOT), str(shared), who]) for who in "ab"]
    assert all(run.wait(timeout=120) == 0 for run in runs)
    with shared.open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["who"] for r in rows) == ["a"] * 40 + ["b"] * 40
