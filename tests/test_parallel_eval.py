"""scripts/parallel_eval.py: grid expansion, skipping, failure reporting, and a real Ray sweep
that must equal the same jobs run one after another. Also checks the sweep scripts' commands."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import parallel_eval
import pytest
from test_tp import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "scripts" / "parallel_eval.py"
# Tiny RULER jobs: 2 samples of ~120 tokens, 4 new tokens each.
EVAL_ARGS = ["--num_samples", "2", "--seq_length", "120", "--max_new_tokens", "4", "--dtype", "float32"]
SWEEPS = ["sweep_strategies.sh", "sweep_attention_loss.sh", "sweep_variable_compression.sh", "sweep_local_global.sh"]


def run_runner(*args, timeout: int = 300, env_changes: dict | None = None) -> subprocess.CompletedProcess:
    """The runner as a command; `env_changes` sets environment variables (None removes one)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0", **(env_changes or {})}
    env = {name: value for name, value in env.items() if value is not None}
    return subprocess.run(
        [sys.executable, str(RUNNER), *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def summary(stdout: str) -> dict[str, list[str]]:
    """The summary table: job name -> [status..., seconds, log]."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("job "))
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        name, *rest = line.split()
        rows[name] = rest
    return rows


@pytest.fixture(scope="module")
def tiny_checkpoint(smollm2_checkpoint, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sweep") / "tiny-sweep", smollm2_checkpoint)


# ---- expanding the jobs ---------------------------------------------------------------------


def jobs_for(argv: list[str]) -> list[parallel_eval.Job]:
    args, extra = parallel_eval.parse_args(argv)
    return parallel_eval.expand_grid(args, extra)


def test_grid_is_the_cartesian_product_plus_full_baselines():
    jobs = jobs_for(
        ["--config_names", "heavy_hitter", "l2", "--tasks", "rulerniah", "rulervt", "--cache_sizes", "0.1", "0.25"]
        + ["--include_full", "--num_samples", "5", "--", "--seq_length", "500"]
    )
    assert len(jobs) == 2 * 2 * 2 + 2
    names = [j.name for j in jobs]
    assert len(set(names)) == len(names)
    assert "heavy_hitter__rulervt__0.25" in names and "full__rulerniah" in names
    for job in jobs:
        argv = job.argv
        assert argv[1] == str(ROOT / "eval.py")
        assert argv[argv.index("--num_samples") + 1] == "5" and argv[argv.index("--seq_length") + 1] == "500"
        assert ("--max_cache_length" in argv) == (not job.name.startswith("full"))


def test_cache_sizes_of_multi_strategy_presets():
    jobs = jobs_for(
        ["--config_names", "local_global", "full", "hybrid", "--tasks", "rulerniah", "--cache_sizes", "0.1", "0.5,0.2"]
    )
    lengths = {j.name: j.argv[j.argv.index("--max_cache_length") + 1 :][:2] for j in jobs if "local" in j.name}
    assert lengths["local_global__rulerniah__0.1"] == ["1.0", "0.1"]  # the local layers take the size
    assert lengths["local_global__rulerniah__0.5_0.2"] == ["0.5", "0.2"]  # 'A,B' is taken as given
    # full and hybrid are not sized by --max_cache_length: one job per task
    assert [j.name for j in jobs if "local" not in j.name] == ["hybrid__rulerniah", "full__rulerniah"]
    assert all("--max_cache_length" not in j.argv for j in jobs if "local" not in j.name)


def test_command_file_lines(tmp_path):
    path = tmp_path / "commands.txt"
    path.write_text(
        "# a comment\n\npython eval.py --tasks rulerniah \\\n  --cache_config l2\n"
        "python eval.py --tasks rulervt\npython eval.py --tasks rulervt\n"
    )
    jobs = parallel_eval.read_command_file(path, ["--num_samples", "3"])
    assert [j.shell for j in jobs] == [
        "python eval.py --tasks rulerniah    --cache_config l2 --num_samples 3",
        "python eval.py --tasks rulervt --num_samples 3",
    ]
    assert jobs[0].name == "001__eval__rulerniah"


@pytest.mark.parametrize(
    "argv",
    [
        ["--tasks", "rulerniah"],  # no configs
        ["--config_names", "l2", "--tasks", "rulerniah"],  # no sizes
        ["--command_file", "x.txt", "--tasks", "rulerniah"],
        ["--config_names", "l2", "--tasks", "a", "--cache_sizes", "0.1", "--ray", "--ray_address", "auto"],
        ["--config_names", "l2", "--tasks", "a", "--cache_sizes", "0.1", "--", "--max_cache_length", "0.3"],
    ],
)
def test_bad_runner_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        parallel_eval.parse_args(argv)
    assert "error:" in capsys.readouterr().err


def test_complete_results_are_recognised(tmp_path, tiny_checkpoint):
    argv = ["--config_names", "recent_global", "--tasks", "rulerniah", "--cache_sizes", "0.5", "--out_dir", tmp_path]
    args, extra = parallel_eval.parse_args([str(a) for a in argv] + ["--checkpoint_path", str(tiny_checkpoint)])
    (job,) = parallel_eval.expand_grid(args, extra + EVAL_ARGS)
    parallel_eval.inspect_job(job)
    folder = Path(job.folder)
    assert folder.parent == tmp_path / tiny_checkpoint.name and not job.complete
    label = "rulerniah__max_new_tokens=4__seq_length=120"  # eval.py's name for the task with its options
    folder.mkdir(parents=True)
    (folder / "args.json").write_text(json.dumps({"seed": 0, "dtype": "float32", "no_chat_template": False}))
    (folder / "all_metrics.json").write_text(json.dumps({label: {"num_samples": 1}}))
    parallel_eval.inspect_job(job)
    assert not job.complete  # 1 of the 2 requested samples
    (folder / "all_metrics.json").write_text(json.dumps({label: {"num_samples": 2}}))
    parallel_eval.inspect_job(job)
    assert job.complete
    (folder / "args.json").write_text(json.dumps({"seed": 0, "dtype": "bfloat16", "no_chat_template": False}))
    parallel_eval.inspect_job(job)
    assert not job.complete  # made with another dtype: eval.py must decide


# ---- failures -------------------------------------------------------------------------------

FAILING_COMMANDS = """\
python -c "import time; time.sleep(1); print('first ok')"
python -c "import sys; print('about to fail'); sys.exit(3)"
python -c "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
python -c "print('last ok')"
"""


def test_failed_and_killed_jobs_are_reported_and_do_not_stop_the_others(tmp_path):
    commands = tmp_path / "commands.txt"
    commands.write_text(FAILING_COMMANDS)
    result = run_runner("--command_file", commands, "--num_workers", "2", "--out_dir", tmp_path / "out")
    assert result.returncode == 1, result.stdout + result.stderr
    rows = summary(result.stdout)
    logs = {name: Path(row[-1]) for name, row in rows.items()}
    assert [row[0] for row in rows.values()] == ["ok", "failed", "failed", "ok"]
    assert "exit code 3" in result.stdout and "killed by SIGKILL" in result.stdout
    assert all(log.parent == tmp_path / "out" / "logs" and log.is_file() for log in logs.values())
    assert "first ok" in logs["001__python"].read_text() and "last ok" in logs["004__python"].read_text()
    assert "about to fail" in logs["002__python"].read_text()
    assert f"see {logs['002__python']}" in result.stdout and f"see {logs['003__python']}" in result.stdout
    rerun = run_runner("--command_file", commands, "--num_workers", "2", "--out_dir", tmp_path / "out")
    assert [row[0] for row in summary(rerun.stdout).values()] == ["ok", "failed", "failed", "ok"]
    log_lines = logs["002__python"].read_text().splitlines()
    assert log_lines.count("about to fail") == 2 and len([s for s in log_lines if s.startswith("=== ")]) == 2


def test_local_cpu_jobs_share_the_cpus_unless_the_user_set_the_threads(tmp_path):
    """Jobs side by side on CPU each get their share of the CPUs as torch's thread count (each taking
    every CPU made them wait on each other's threads); OMP_NUM_THREADS set by the user is kept."""
    commands = tmp_path / "commands.txt"
    line = "python -c \"import os, torch; print(f'threads={{torch.get_num_threads()}} {}', os.environ['OMP_NUM_THREADS'])\"\n"
    commands.write_text(line.format("job 1") + line.format("job 2"))
    cpus = parallel_eval.usable_cpus()

    def job_threads(out: Path, user_threads: str | None = None) -> list[str]:
        result = run_runner(
            "--command_file", commands, "--num_workers", "2", "--out_dir", out,
            env_changes={"CUDA_VISIBLE_DEVICES": "-1", "OMP_NUM_THREADS": user_threads},
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        logs = sorted((out / "logs").glob("*.log"))
        return [line for log in logs for line in log.read_text().splitlines() if line.startswith("threads=")]

    share = max(1, cpus // 2)
    assert job_threads(tmp_path / "shared") == [f"threads={share} job 1 {share}", f"threads={share} job 2 {share}"]
    assert [line.split()[-1] for line in job_threads(tmp_path / "user", "3")] == ["3", "3"]


# ---- a real sweep on Ray vs one after another ------------------------------------------------


def read_results(out_dir: Path, model: str) -> dict:
    """Per results folder: the predictions (id, text, compression) and the metrics, without timings."""
    results = {}
    for folder in sorted((out_dir / model).iterdir()):
        metrics = json.loads((folder / "all_metrics.json").read_text())
        entry = {label: (m["metrics"], m["num_samples"], m["statistics"]["compression_ratio"]) for label, m in metrics.items()}  # fmt: skip
        for path in sorted(folder.glob("*_predictions.csv")):
            with open(path, newline="") as f:
                entry[path.name] = [(r["id"], r["prediction"], r["compression_ratio"]) for r in csv.DictReader(f)]
        results[folder.name] = entry
    return results


@pytest.mark.slow
def test_ray_sweep_equals_sequential_runs(tiny_checkpoint, tmp_path):
    grid = ["--config_names", "recent_global", "heavy_hitter", "--tasks", "rulerniah", "--cache_sizes", "0.5", "0.75"]
    extra = ["--", "--checkpoint_path", tiny_checkpoint, *EVAL_ARGS]

    on_ray = run_runner(*grid, "--ray", "--num_workers", "2", "--out_dir", tmp_path / "ray", *extra)
    assert on_ray.returncode == 0, on_ray.stdout + on_ray.stderr
    assert "Ray (local): 2 CPU(s)" in on_ray.stdout
    rows = summary(on_ray.stdout)
    assert len(rows) == 4 and all(row[0] == "ok" for row in rows.values())

    one_by_one = run_runner(*grid, "--num_workers", "1", "--out_dir", tmp_path / "seq", *extra)
    assert one_by_one.returncode == 0, one_by_one.stdout + one_by_one.stderr

    parallel, sequential = read_results(tmp_path / "ray", tiny_checkpoint.name), read_results(tmp_path / "seq", tiny_checkpoint.name)  # fmt: skip
    assert len(parallel) == 4 and all(len(csv_rows) == 2 for e in parallel.values() for k, csv_rows in e.items() if k.endswith(".csv"))  # fmt: skip
    assert parallel == sequential
    heavy = [e for name, e in parallel.items() if name.startswith("heavy_hitter")]
    assert heavy and all(v[2] > 0.1 for e in heavy for k, v in e.items() if not k.endswith(".csv"))  # it compressed

    again = run_runner(*grid, "--out_dir", tmp_path / "seq", *extra)  # complete results: nothing reruns
    assert again.returncode == 0 and [row[0] for row in summary(again.stdout).values()] == ["skipped"] * 4


@pytest.mark.slow
def test_ray_failed_job_and_killed_worker_leave_the_others_finished(tiny_checkpoint, tmp_path):
    good = [sys.executable, "eval.py", "--tasks", "rulerniah", "--cache_config", "recent_global"]
    good += [
        "--max_cache_length",
        "0.5",
        "--out_dir",
        tmp_path / "out",
        "--checkpoint_path",
        tiny_checkpoint,
        *EVAL_ARGS,
    ]
    commands = tmp_path / "commands.txt"
    commands.write_text(
        " ".join(map(str, good))
        + "\npython eval.py --tasks rulerniah --cache_strategy no_such_strategy"
        + '\npython -c "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"\n'  # kills its Ray worker
    )
    result = run_runner("--command_file", commands, "--ray", "--num_workers", "2", "--out_dir", tmp_path / "out")
    assert result.returncode == 1, result.stdout + result.stderr
    rows = summary(result.stdout)
    assert [row[0] for row in rows.values()] == ["ok", "failed", "failed"]
    assert "unknown cache strategy 'no_such_strategy'" in Path(rows["002__eval__rulerniah"][-1]).read_text()
    assert "Ray worker died" in result.stdout
    for name in ("002__eval__rulerniah", "003__python"):
        assert f"see {rows[name][-1]}" in result.stdout
    assert list((tmp_path / "out" / tiny_checkpoint.name).glob("recent_global*/all_metrics.json"))


# ---- the sweep scripts ----------------------------------------------------------------------


@pytest.mark.parametrize("script", SWEEPS)
def test_sweep_scripts_print_valid_eval_commands(script):
    """DRY_RUN=1 prints one eval.py command per configuration; each parses and passes the
    compatibility checks for a 30-layer model (SmolLM2)."""
    import shlex

    import eval as eval_py
    from cache_args import check_compatibility, parse_args_with_cache_config

    env = {**os.environ, "DRY_RUN": "1", "NUM_SAMPLES": "3", "BUDGETS": "0.1 0.25", "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), "--dtype", "float32"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(commands) >= 2
    folders = set()
    for words in commands:
        argv = parallel_eval.eval_argv(words)
        assert argv is not None and "--dtype" in argv and "--num_samples" in argv
        args = parse_args_with_cache_config(eval_py.build_parser(), argv)
        eval_py.resolve_tasks(args)
        check_compatibility(dict(vars(args)), 30)
        folders.add(eval_py.config_folder_name(dict(vars(args))))
    assert len(folders) == len(commands)  # every configuration writes its own results folder
