"""Run many eval.py jobs in parallel: on local worker processes, or on a Ray cluster.

A grid of cache configurations x tasks x cache sizes (plus an optional full-cache baseline):

    python scripts/parallel_eval.py --config_names recent_global heavy_hitter l2 \
        --tasks rulerniah rulervt --cache_sizes 0.1 0.25 0.5 --include_full \
        --num_workers 2 -- --num_samples 50 --seq_length 4000

or a file of eval.py commands, one per line (blank lines and `#` comments are skipped):

    python scripts/parallel_eval.py --command_file commands.txt --ray_address auto

Arguments the runner does not know (or everything after `--`) are passed to every eval.py job.
Jobs run on `--num_workers` local processes by default (one GPU each when GPUs exist); with
`--ray_address auto|HOST:PORT` they run on that Ray cluster, with `--ray` on a local Ray started
here, each job a Ray task that takes one GPU (`num_gpus=1`) where the cluster has GPUs and
`--cpus_per_job` CPUs otherwise. On a multi-node cluster the repository, checkpoints and
`--out_dir` must be at the same path on every node (a shared filesystem).

Jobs whose results are already complete (all_metrics.json of their results folder holds every
requested task, with as many samples as asked for) are skipped; others rerun and eval.py resumes
from the samples already written. Jobs writing the same results folder (the same configuration
with different tasks) never run at the same time. Each job's output goes to
`<out_dir>/logs/<job>.log` (a rerun appends); a failed job is reported with its log and does not stop the others.
A summary table ends the run; the exit code is 1 when any job failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EVAL_PY = ROOT / "eval.py"
sys.path.insert(0, str(ROOT))
import strategies  # noqa: E402
from cache_args import load_cache_config, parse_args_with_cache_config  # noqa: E402

LOG_TAIL_BYTES = 1 << 16


@dataclass
class Job:
    name: str
    argv: list[str] | None = None  # an eval.py command, run without a shell
    shell: str | None = None  # a line of a command file, run by bash
    folder: str | None = None  # eval.py's results folder, when the command could be parsed
    complete: bool = False  # every requested task already has results
    status: str = "pending"
    seconds: float = 0.0
    log: str = ""
    detail: str = ""
    env: dict = field(default_factory=dict)
    started: float = 0.0

    @property
    def command(self) -> str:
        return self.shell if self.shell is not None else shlex.join(self.argv)


# ---- building the job list ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    grid = parser.add_argument_group("the grid (or --command_file)")
    grid.add_argument("--config_names", nargs="+", default=[], help="YAML presets in cache_configs/ (or paths)")
    grid.add_argument("--tasks", nargs="+", default=[], help="eval.py task names (each a job of its own)")
    grid.add_argument("--cache_sizes", nargs="+", default=[],
                      help="--max_cache_length values; 'A,B' passes a per-layer list as is")  # fmt: skip
    grid.add_argument("--include_full", action="store_true", help="add the full-cache baseline for every task")
    grid.add_argument("--command_file", type=Path, default=None, help="one eval.py command per line")
    run = parser.add_argument_group("where the jobs run")
    run.add_argument("--num_workers", type=int, default=None,
                     help="local: parallel jobs (default: one per GPU, else 1); --ray: the CPUs of the local Ray; "
                          "--ray_address: at most this many jobs in flight")  # fmt: skip
    run.add_argument("--ray", action="store_true", help="start a local Ray cluster and run the jobs on it")
    run.add_argument("--ray_address", default=None, help="an existing Ray cluster: auto or HOST:PORT")
    run.add_argument("--cpus_per_job", type=float, default=1, help="Ray CPUs per job on clusters without GPUs")
    run.add_argument("--job_timeout", type=float, default=None, help="seconds before a job is killed (failed)")
    parser.add_argument(
        "--out_dir", type=Path, default=Path("results"), help="passed to eval.py; logs go to OUT_DIR/logs"
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter for the generated eval.py commands")
    parser.add_argument("--no_skip", action="store_true", help="run jobs even when their results are complete")
    parser.add_argument("--dry_run", action="store_true", help="print the commands (a valid --command_file) and exit")
    return parser


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command_file is None and not (args.tasks and (args.config_names or args.include_full)):
        parser.error("give --command_file, or --tasks with --config_names and/or --include_full")
    if args.command_file is not None and (args.config_names or args.tasks or args.cache_sizes or args.include_full):
        parser.error("--command_file replaces --config_names/--tasks/--cache_sizes/--include_full")
    if args.config_names and not args.cache_sizes and not all(sizeless(c) for c in args.config_names):
        parser.error("--config_names needs --cache_sizes (the --max_cache_length values to sweep)")
    if args.ray and args.ray_address:
        parser.error("give --ray (a local Ray started here) or --ray_address (an existing cluster), not both")
    if args.num_workers is not None and args.num_workers < 1:
        parser.error("--num_workers must be at least 1")
    if any(a in ("--out_dir", "--cache_config", "--max_cache_length", "--tasks") for a in unknown + passthrough):
        parser.error("pass --out_dir, --tasks, --max_cache_length and --cache_config through the runner's own flags")
    return args, unknown + passthrough


def preset_strategies(config_name: str) -> list:
    """The strategy classes a preset uses; none when it cannot be read (reported when the jobs are built)."""
    try:
        names = load_cache_config(config_name).get("cache_strategy", [strategies.DEFAULT_STRATEGY])
        return [strategies.strategy_class(name) for name in names]
    except ValueError:
        return []


def is_full(config_name: str) -> bool:
    """A baseline preset: every layer keeps every token (results are compared against it)."""
    classes = preset_strategies(config_name)
    return bool(classes) and all(c.name in strategies.baseline_strategies() for c in classes)


def sizeless(config_name: str) -> bool:
    """Presets whose caches span the whole sequence (the baseline, FastGen-style policies): not swept over sizes."""
    classes = preset_strategies(config_name)
    return bool(classes) and all(c.spans_sequence for c in classes)


def size_values(config_name: str, size: str) -> list[str]:
    """--max_cache_length values for one cache size. 'A,B' is taken as given; a preset that lists one
    length per strategy (e.g. local_global's [1.0, 0.25]) gets `size` in place of its lengths below 1.0."""
    if "," in size:
        return [s for s in size.split(",") if s]
    lengths = load_cache_config(config_name).get("max_cache_length") or []
    if len(lengths) > 1:
        return [str(v) if float(v) == 1.0 else size for v in lengths]
    return [size]


def baseline_preset() -> list[str]:
    """The preset named for the baseline strategy (cache_configs/<name>.yaml)."""
    return strategies.baseline_strategies()[:1]


def job_name(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", "__".join(parts)).strip("_")[:150]


def expand_grid(args, extra: list[str]) -> list[Job]:
    """configs x tasks x sizes, then the full-cache baselines (one per task). Presets that are not
    sized by --max_cache_length (hybrid) get one job per task."""
    base = [args.python, str(EVAL_PY)]
    out = ["--out_dir", str(args.out_dir)]
    jobs = []
    for config in args.config_names:
        if is_full(config):
            continue
        if sizeless(config):
            for task in args.tasks:
                argv = [*base, "--cache_config", config, "--tasks", task, *out, *extra]
                jobs.append(Job(job_name(Path(config).stem, task), argv=argv))
            continue
        for size in args.cache_sizes:
            values = size_values(config, size)
            for task in args.tasks:
                argv = [*base, "--cache_config", config, "--tasks", task, "--max_cache_length", *values, *out, *extra]
                jobs.append(Job(job_name(Path(config).stem, task, size), argv=argv))
    full_configs = [c for c in args.config_names if is_full(c)] or (baseline_preset() if args.include_full else [])
    for task in args.tasks if full_configs else []:
        argv = [*base, "--cache_config", full_configs[0], "--tasks", task, *out, *extra]
        jobs.append(Job(job_name(Path(full_configs[0]).stem, task), argv=argv))
    return jobs


def read_command_file(path: Path, extra: list[str]) -> list[Job]:
    """One command per line (a trailing backslash continues it); blank lines and # comments skipped."""
    if not path.is_file():
        sys.exit(f"error: command file {path} not found")
    commands, current = [], ""
    for line in path.read_text().splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current.strip())
        current = ""
    if current.strip() and not current.lstrip().startswith("#"):
        commands.append(current.strip())
    jobs = []
    for i, command in enumerate(dict.fromkeys(commands), 1):  # a repeated line is one job
        if extra:
            command = f"{command} {shlex.join(extra)}"
        words = shlex.split(command, comments=True) if command else []
        script = next((Path(w).name for w in words if w.endswith(".py")), Path(words[0]).name if words else "job")
        tasks = eval_argv(words)
        label = "_".join(tasks[tasks.index("--tasks") + 1 :][:1]) if tasks and "--tasks" in tasks else ""
        jobs.append(Job(job_name(f"{i:03d}", Path(script).stem, label), shell=command))
    return jobs


def eval_argv(words: list[str]) -> list[str] | None:
    """The arguments after `eval.py` in a command, or None when it does not run eval.py."""
    for i, word in enumerate(words):
        if Path(word).name == "eval.py":
            return words[i + 1 :]
    return None


# ---- skipping finished jobs -----------------------------------------------------------------


def inspect_job(job: Job) -> None:
    """Sets job.folder (eval.py's results folder) and job.complete, using eval.py's own naming.
    A command that is not an eval.py command, or that eval.py would reject, is simply run."""
    words = job.argv if job.argv is not None else shlex.split(job.shell, comments=True)
    argv = eval_argv(words)
    if argv is None:
        return
    try:
        import eval as eval_py

        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            args = parse_args_with_cache_config(eval_py.build_parser(), argv)
            labels = [label for label, _ in eval_py.resolve_tasks(args)]
            folder = Path(args.out_dir) / Path(args.checkpoint_path).name / eval_py.config_folder_name(dict(vars(args)))
    except (SystemExit, Exception):  # eval.py will report the problem in the job's log
        return
    job.folder = str(folder.resolve()) if not folder.is_absolute() else str(folder)
    job.complete = results_complete(folder, labels, args)


def results_complete(folder: Path, labels: list[str], args) -> bool:
    try:
        done = json.loads((folder / "all_metrics.json").read_text())
        previous = json.loads((folder / "args.json").read_text())
    except (OSError, ValueError):
        return False
    for key in ("seed", "dtype", "no_chat_template", "data_dir"):  # what changes the samples or outputs
        mine = getattr(args, key)
        if key in previous and previous[key] != (str(mine) if isinstance(mine, Path) else mine):
            return False
    for label in labels:
        if label not in done:
            return False
        if args.num_samples is not None and done[label].get("num_samples", 0) < args.num_samples:
            return False  # maybe fewer fit the context: eval.py's resume then finishes at once
    return True


# ---- running one job ------------------------------------------------------------------------


def die_with_parent():
    """A preexec_fn that has the job killed when the worker that started it dies (Linux), so no job
    outlives an interrupted runner or a killed Ray worker; None where prctl is not available.
    Resolved in the parent: the child, forked from a threaded process, must not import anything."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_command(argv, shell, log_path: str, cwd: str, env: dict, timeout: float | None, active=None) -> dict:
    """Runs one job as a subprocess (its own process group), output to log_path; used locally and
    as the body of the Ray task. `active` (a dict) holds the running process by pid, for an interrupt.
    Returns returncode, seconds and the tail of the log."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = ["bash", "-c", shell] if shell is not None else argv
    timed_out = False
    with open(log_path, "ab") as log:  # a rerun keeps the earlier runs' output above its own
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"=== {stamp}\n$ {shell if shell is not None else shlex.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed as one
            preexec_fn=die_with_parent(),
        )
        if active is not None:
            active[proc.pid] = proc
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
            returncode = proc.wait()
        except BaseException:  # interrupted (Ctrl-C, Ray cancel): take the job down with us
            kill_group(proc)
            proc.wait()
            raise
        finally:
            if active is not None:
                active.pop(proc.pid, None)
    with open(log_path, "rb") as log:
        log.seek(max(0, os.path.getsize(log_path) - LOG_TAIL_BYTES))
        tail = log.read().decode("utf-8", errors="replace")
    return {"returncode": returncode, "seconds": time.time() - start, "tail": tail, "timed_out": timed_out}


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def describe_exit(result: dict) -> tuple[str, str]:
    code = result["returncode"]
    if result.get("timed_out"):
        return "failed", "killed after --job_timeout"
    if code == 0:
        return "ok", ""
    if code < 0:
        return "failed", f"killed by {signal.Signals(-code).name}"
    if code in (128 + signal.SIGKILL, 128 + signal.SIGTERM):  # bash reports a killed child this way
        return "failed", f"killed by {signal.Signals(code - 128).name}"
    return "failed", f"exit code {code}"


# ---- backends -------------------------------------------------------------------------------


class LocalBackend:
    """Worker threads that each wait on one job subprocess; a GPU per worker when GPUs exist, else (with
    several workers) an equal share of the CPUs: torch takes every core in each job, and jobs side by
    side that each run that many threads wait on each other's threads (several times slower than
    alone). OMP_NUM_THREADS set by the user wins."""

    def __init__(self, num_workers: int | None, timeout: float | None):
        gpus = visible_gpus()
        self.capacity = num_workers or max(1, len(gpus))
        self.threads = None
        if not gpus and self.capacity > 1 and "OMP_NUM_THREADS" not in os.environ:
            self.threads = max(1, usable_cpus() // self.capacity)
        self.timeout = timeout
        self.pool = concurrent.futures.ThreadPoolExecutor(self.capacity)
        self.free_gpus = gpus
        self.lock = threading.Lock()
        self.active: dict[int, subprocess.Popen] = {}
        self.verb = "start"
        self.where = f"{self.capacity} local worker(s)" + (f", {len(gpus)} GPU(s)" if gpus else ", CPU")
        if self.threads:
            self.where += f", {self.threads} thread(s) each"

    def submit(self, job: Job) -> concurrent.futures.Future:
        return self.pool.submit(self._run, job)

    def _run(self, job: Job) -> dict:
        gpu = None
        with self.lock:
            if self.free_gpus:
                gpu = self.free_gpus.pop(0)
        env = dict(job.env)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        elif self.threads:
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
        try:
            return run_command(job.argv, job.shell, job.log, os.getcwd(), env, self.timeout, self.active)
        finally:
            if gpu is not None:
                with self.lock:
                    self.free_gpus.append(gpu)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(self.active.values()):  # only left after an interrupt
            kill_group(proc)


class RayBackend:
    """One Ray task per job: num_gpus=1 where the cluster has GPUs, else --cpus_per_job CPUs."""

    def __init__(self, address: str | None, num_cpus: int | None, cpus_per_job: float, cap: int | None, timeout):
        try:
            import ray
        except ImportError:
            sys.exit("error: Ray is not installed; pip install ray (or run without --ray/--ray_address)")
        self.ray = ray
        self.started_here = address is None
        if address is None:
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)
        else:
            try:
                ray.init(address=address, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                sys.exit(f"error: cannot connect to the Ray cluster at '{address}': {str(e).splitlines()[0]}")
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        options = {"num_gpus": 1, "num_cpus": cpus_per_job} if gpus else {"num_cpus": cpus_per_job}
        module = sys.modules[run_command.__module__]
        if module.__name__ != "__main__":  # imported (tests): ship the code, workers cannot import it
            ray.cloudpickle.register_pickle_by_value(module)
        self.remote = ray.remote(max_retries=0)(run_command).options(**options)
        self.capacity = cap or 1 << 30  # Ray queues by resources; --num_workers caps jobs in flight
        self.timeout = timeout
        self.verb = "submit"
        kind = (
            f"{gpus} GPU(s), one per job" if gpus else f"{resources.get('CPU', 0):g} CPU(s), {cpus_per_job:g} per job"
        )
        self.where = f"Ray {'(local)' if self.started_here else address}: {kind}"

    def submit(self, job: Job) -> concurrent.futures.Future:
        ref = self.remote.remote(job.argv, job.shell, job.log, os.getcwd(), job.env, self.timeout)
        return ref.future()

    def close(self) -> None:
        self.ray.shutdown()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The GPU ids a job may be pinned to with CUDA_VISIBLE_DEVICES (none on a CPU machine)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        return [] if not ids or ids[0] == "-1" else ids
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    lines = [line for line in out.stdout.splitlines() if line.startswith("GPU ")] if out.returncode == 0 else []
    return [str(i) for i in range(len(lines))]


# ---- scheduling -----------------------------------------------------------------------------


def run_jobs(jobs: list[Job], backend) -> None:
    """Submits jobs as capacity allows, never two with the same results folder at once."""
    pending = [j for j in jobs if j.status == "pending"]
    running: dict[concurrent.futures.Future, Job] = {}
    busy: set[str] = set()
    total, finished = len(pending), 0
    try:
        while pending or running:
            for job in list(pending):
                if len(running) >= backend.capacity:
                    break
                if job.folder is not None and job.folder in busy:
                    continue
                pending.remove(job)
                if job.folder is not None:
                    busy.add(job.folder)
                job.status, job.started = "running", time.time()
                print(f"[{backend.verb}] {job.name}  (log: {job.log})", flush=True)
                try:
                    running[backend.submit(job)] = job
                except Exception as e:  # e.g. the cluster refused the task
                    job.status, job.detail = "failed", f"not submitted: {type(e).__name__}: {first_line(str(e))}"
                    busy.discard(job.folder)
            if not running:
                continue
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                job = running.pop(future)
                busy.discard(job.folder)
                finish(job, future)
                finished += 1
                tag = "ok" if job.status == "ok" else "FAILED"
                print(f"[{tag}] {job.name} ({finished}/{total}, {job.seconds:.1f} s){'  ' + job.detail if job.detail else ''}", flush=True)  # fmt: skip
    except BaseException:  # Ctrl-C, SIGTERM (Ray's handler exits): report what was cut short
        for job in running.values():
            job.status, job.detail = "failed", "interrupted"
        for job in pending:
            job.status = "not run"
        raise


def finish(job: Job, future: concurrent.futures.Future) -> None:
    try:
        result = future.result()
    except Exception as e:  # the Ray worker died (killed, out of memory) or the task could not run
        job.seconds = time.time() - job.started
        crashed = type(e).__name__ in ("WorkerCrashedError", "NodeDiedError", "OutOfMemoryError")
        job.status = "failed"
        job.detail = f"Ray worker died ({type(e).__name__})" if crashed else f"{type(e).__name__}: {first_line(str(e))}"
        return
    job.seconds = result["seconds"]
    job.status, job.detail = describe_exit(result)
    if not Path(job.log).is_file():  # ran on another node without a shared filesystem
        Path(job.log).parent.mkdir(parents=True, exist_ok=True)
        Path(job.log).write_text(result["tail"])


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def print_summary(jobs: list[Job]) -> None:
    rows = [(j.name, j.status + (f" ({j.detail[:60]})" if j.detail else ""), f"{j.seconds:.1f}", j.log) for j in jobs]
    header = ("job", "status", "seconds", "log")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    print()
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
    counts = {s: sum(j.status == s for j in jobs) for s in ("ok", "skipped", "failed", "not run")}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    for job in jobs:
        if job.status == "failed":
            print(f"failed: {job.name}: {job.detail}; see {job.log}")


def interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    args.out_dir = args.out_dir.resolve()  # jobs may run elsewhere (another node)
    try:
        jobs = read_command_file(args.command_file, extra) if args.command_file else expand_grid(args, extra)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not jobs:
        sys.exit("error: no jobs to run")
    if args.dry_run:
        for job in jobs:
            print(job.command)
        return 0
    log_dir = args.out_dir / "logs"
    for job in jobs:
        job.log = str(log_dir / f"{job.name}.log")
        inspect_job(job)
        if job.complete and not args.no_skip:
            job.status, job.detail = "skipped", "results exist"
    todo = [j for j in jobs if j.status == "pending"]
    backend = None
    if todo:
        if args.ray or args.ray_address:
            backend = RayBackend(args.ray_address, args.num_workers, args.cpus_per_job, args.num_workers if args.ray_address else None, args.job_timeout)  # fmt: skip
        else:
            backend = LocalBackend(args.num_workers, args.job_timeout)
        print(f"{len(todo)} job(s) to run, {len(jobs) - len(todo)} skipped; on {backend.where}", flush=True)
        if threading.current_thread() is threading.main_thread():  # after ray.init, which sets its own
            signal.signal(signal.SIGTERM, interrupt)  # a killed runner stops its jobs and still reports
    try:
        if backend is not None:
            run_jobs(jobs, backend)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        if backend is not None:
            backend.close()
        print_summary(jobs)
    return 0 if all(j.status in ("ok", "skipped") for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
