"""Prefill-then-decode loop, cache setup and compile: shared by generate.py, eval.py and benchmark.py."""

import contextlib
import os
import resource
import time
from pathlib import Path

import torch
from torch import Tensor

import cpu_backend
from cache import cache_state, cache_statistics, load_cache_state
from model import ModelArgs, Transformer
from strategies import create_caches

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "SmolLM2-135M-Instruct"
PREPARE_HINT = {
    "SmolLM2-135M-Instruct": "bash scripts/prepare_smollm2.sh (or: make demo)",
    "gemma-3-270m": "bash scripts/prepare_gemma3.sh (or: make gemma3)",
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BACKENDS = ("auto", "none")  # auto: the CPU back-end's kernels on CPU; none: the plain model everywhere


class CheckpointError(ValueError):
    """A missing or unreadable checkpoint: a user mistake, reported in one line."""


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device '{name}'; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' is not available on this machine; use --device cpu")
    if device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValueError(f"unsupported device '{name}'; use cpu or cuda")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; choose from: {', '.join(DTYPES)}")
    return DTYPES[name]


def checkpoint_config(checkpoint_dir: Path) -> ModelArgs:
    """The model config of a checkpoint folder, read without touching the weights."""
    checkpoint_dir = Path(checkpoint_dir)
    weights = checkpoint_dir / "model.pth"
    if not weights.is_file():
        hint = PREPARE_HINT.get(checkpoint_dir.name, "python scripts/download.py --repo_id ORG/NAME")
        raise CheckpointError(f"checkpoint {weights} not found; prepare it with: {hint}")
    return ModelArgs.from_checkpoint_dir(checkpoint_dir)


def load_model(checkpoint_dir: Path, device, dtype: torch.dtype, shard=None, backend: str = "auto") -> Transformer:
    """`shard(model)` (e.g. tp.apply_tp) runs on the memory-mapped CPU weights, before the move to `device`;
    then `backend` auto swaps in the CPU back-end's kernels where the device is the CPU."""
    config = checkpoint_config(checkpoint_dir)
    weights = Path(checkpoint_dir) / "model.pth"
    try:
        state_dict = torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises several types for a truncated or foreign file
        raise CheckpointError(
            f"checkpoint {weights} is corrupt or truncated ({type(e).__name__}); prepare it again"
        ) from None
    with torch.device("meta"):
        model = Transformer(config)
    try:
        model.load_state_dict(state_dict, assign=True, strict=not config.tie_embeddings)
    except RuntimeError as e:
        raise CheckpointError(
            f"checkpoint {weights} does not match its config: {str(e).splitlines()[1].strip()}"
        ) from None
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if shard is not None:
        shard(model)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return cpu_backend.apply(model) if backend == "auto" else model


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, generators=None) -> Tensor:
    """Next token from the last position's logits [B, vocab]: greedy at temperature 0. `generators`
    (one per sequence) draw each sequence's randomness, so that it samples alike alone or in a batch;
    without them, torch's global generator."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1:]
        logits = torch.where(logits < kth, -float("inf"), logits)
    probs = torch.softmax(logits, dim=-1)
    # Exponential race instead of multinomial: no host sync.
    if generators is None:
        noise = torch.empty_like(probs).exponential_(1)
    else:
        noise = torch.stack([torch.empty_like(row).exponential_(1, generator=g) for row, g in zip(probs, generators)])
    return torch.argmax(probs / noise, dim=-1, keepdim=True)


def prefill(model: Transformer, x: Tensor, input_pos: Tensor, extends: bool = False) -> Tensor:
    """Logits [B, vocab] of the last prompt position; `extends`: a later chunk of the prompt."""
    return model(x, input_pos, is_prefill=True, last_only=True, extends=extends)[:, -1]


def decode_one_token(model: Transformer, x: Tensor, input_pos: Tensor) -> Tensor:
    """Logits [B, vocab] for one token x [B, 1] at input_pos [1]."""
    return model(x, input_pos, is_prefill=False)[:, -1]


def setup_caches(
    model: Transformer, cache_kwargs: dict, prompt_length: int, max_new_tokens: int, batch_size: int = 1
) -> list:
    """The model's caches for `batch_size` sequences."""
    config = model.config
    device, dtype = model.output.weight.device, model.output.weight.dtype
    caches = create_caches(
        cache_kwargs,
        config.n_layer,
        model.layers[0].attention.n_local_heads,  # this rank's KV heads under tensor parallel (tp.py)
        config.head_dim,
        prompt_length,
        max_new_tokens,
        device,
        dtype,
        batch_size,
        windows=[layer.attention.window for layer in model.layers],
    )
    model.setup_caches(caches, prompt_length + max_new_tokens)
    return caches


def prefill_passes(
    length: int, caches: list, chunk_size: int | None, start: int = 0, reserve: int = 0
) -> tuple[list[tuple[int, int]], int]:
    """The spans [begin, end) prefill takes, pass by pass, of `length` tokens at positions start..,
    and the first position teacher-forced through decode steps instead.

    By default one pass. Into empty caches, a prompt exactly as long as the smallest cache keeps its
    last token for a decode step, so strategies record state before the first eviction; chunk size
    1 prefills one cache length and feeds the rest one token at a time, evicting as decode does.
    Larger chunks are prefilled in turn, each through what the caches hold.
    """
    end = start + length
    if chunk_size == 1 and start > 0:
        return [], start
    if start == 0 and (chunk_size in (None, 1) or chunk_size >= length):
        smallest = min(c.budget for c in caches)
        if chunk_size == 1 and length > smallest:
            return [(0, smallest)], smallest
        n = length - 1 if length == smallest and length > 1 and not reserve else length
        return [(0, n)], n
    step = chunk_size or length
    return [(begin, min(begin + step, end)) for begin in range(start, end, step)], end


RECOMPILE_LIMIT = 64  # eval and benchmark reuse the compiled steps across many cache configurations


def compile_steps(model_fns: dict, device: torch.device) -> dict:
    """torch.compile of the decode step (fixed shapes) and of prefill (dynamic prompt length).

    The options keep compiled tokens equal to eager's: inductor's RNG would make `random` eviction
    differ, so it falls back to eager's; precision casts are emulated so fused bfloat16 kernels round
    where eager rounds. Only dynamo's recompile limit is raised, for all callers.

    On CUDA decode replays CUDA graphs, as gpt-fast's does: the caches are module buffers updated in
    place, so one graph serves every step (its logits are copied out before the next replay). On CPU
    decode freezes the weights into the graph (cache buffers stay mutable; inductor's freezing is
    patched around each call, as dynamo reads it while tracing), so compiled steps serve one model,
    and calls its kernels from generated C++ (cpp_wrapper); the matmuls stay ATen's or the CPU
    back-end's packed oneDNN products (no weight prepacking by inductor, whose fused products round
    differently). Prefill does not freeze: inductor would prepack and fuse its projections, or fold
    the float32 upcast of every weight into constants.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    common = {"fallback_random": True, "emulate_precision_casts": True}
    prefill = torch.compile(model_fns["prefill"], dynamic=True, options={**common, "freezing": False})
    if device.type == "cuda":
        graphed = torch.compile(model_fns["decode"], fullgraph=True, options={**common, "triton.cudagraphs": True})
        return {"decode": lambda *args: graphed(*args).clone(), "prefill": prefill}
    decode = torch.compile(
        model_fns["decode"],
        fullgraph=True,
        options={**common, "cpp.weight_prepack": False, "cpp_wrapper": device.type == "cpu"},
    )
    freezing = torch._inductor.config.patch(freezing=True)  # dynamo reads it while tracing, at call time
    return {"decode": freezing(decode), "prefill": prefill}


STEPS = {"prefill": prefill, "decode": decode_one_token}


def peak_memory_bytes(device: torch.device) -> int:
    """GPU allocator peak on CUDA, process peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_output_path(path: Path | None, flag: str) -> None:
    """Proves an output file can be written before the work starts, so a bad path fails in one line
    instead of losing a finished run: its folder is created and a probe file written beside it."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file path")
    probe = path.parent / f".{path.name}.write_probe.{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise ValueError(f"cannot write {flag} {path} ({e.strerror}); choose a writable path") from None


@contextlib.contextmanager
def torch_profile(path: Path | None, device: torch.device, label: str, n_rows: int = 15):
    """Runs the body under the torch profiler, writes a chrome trace to `path` and prints the top ops.

    Without a path the body just runs: callers need no second code path.
    """
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        with record_function(label):
            yield
        synchronize(device)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"profile: {path} (open in chrome://tracing or https://ui.perfetto.dev)")
    print(prof.key_averages().table(sort_by=sort, row_limit=n_rows))


def prefill_prompt(
    model: Transformer,
    prompt_ids: Tensor,
    new_tokens: int,
    cache_kwargs: dict,
    steps: dict,
    context_length: int | None = None,
    on_context=None,
):
    """Sizes the caches, prefills the prompt and teacher-forces any tail; returns (last logits, caches, seconds).

    With `context_length`, the prompt's first tokens are a context compressed, with room kept for
    the rest (the question), before the rest is seen; `on_context(caches)` then sees the caches.
    """
    caches = setup_caches(model, cache_kwargs, prompt_ids.numel(), new_tokens)
    chunk_size = cache_kwargs.get("prefill_chunk_size")
    start = time.perf_counter()
    if context_length is None:
        logits = prefill_through(model, steps, prompt_ids, caches, chunk_size)
    else:
        question_length = prompt_ids.numel() - context_length
        prefill_through(model, steps, prompt_ids[:context_length], caches, chunk_size, reserve=question_length)
        if on_context is not None:
            on_context(caches)
        logits = prefill_through(model, steps, prompt_ids[context_length:], caches, chunk_size, start=context_length)
    synchronize(model.output.weight.device)
    return logits, caches, time.perf_counter() - start


def prefill_through(
    model: Transformer,
    steps: dict,
    ids: Tensor,
    caches: list,
    chunk_size: int | None = None,
    start: int = 0,
    reserve: int = 0,
) -> Tensor:
    """Prefills ids [T] at positions start.. into caches holding positions < start, pass by pass
    (`prefill_passes`), compressing to each cache's length less `reserve` slots kept for tokens still
    to come; returns the last logits."""
    device = model.output.weight.device
    passes, fed = prefill_passes(ids.numel(), caches, chunk_size, start, reserve)
    for cache in caches:  # a sliding layer's window cache keeps no room: later tokens push the oldest out
        cache.reserved_slots = reserve if cache.window is None else 0
    for begin, end in passes:
        positions = torch.arange(begin, end, device=device)
        logits = steps["prefill"](model, ids[begin - start : end - start].view(1, -1), positions, begin > 0)
    request = next((r for r in (c.reconstruction_prompt() for c in caches) if r is not None), None)
    if request is not None:
        reconstruct_context(model, steps, request, ids[: fed - start], fed, caches)
    for cache in caches:
        cache.reserved_slots = 0
    for pos in range(fed, start + ids.numel()):
        logits = steps["decode"](model, ids[pos - start].view(1, 1), torch.tensor([pos], device=device))
    return logits


RECONSTRUCTION_CHUNK = 512


def reconstruct_context(model: Transformer, steps: dict, request: list[int], context: Tensor, end: int, caches):
    """KVzip's scoring pass, for caches holding a whole context that does not fit them: the model
    reads `request` (ask to repeat the context) and the context again, teacher-forced in chunks at
    positions from `end`. Every cache attends to these tokens without keeping them; those waiting
    record the attention each context token receives, then compress to their budget."""
    device = model.output.weight.device
    tokens = torch.cat([torch.tensor(request, dtype=torch.long, device=device), context])
    if model.freqs_cis.shape[0] < end + tokens.numel():
        model.setup_caches(caches, end + tokens.numel())
    try:
        for cache in caches:
            cache.set_peeking(True)
        for begin in range(0, tokens.numel(), RECONSTRUCTION_CHUNK):
            piece = tokens[begin : begin + RECONSTRUCTION_CHUNK]
            positions = torch.arange(end + begin, end + begin + piece.numel(), device=device)
            steps["prefill"](model, piece.view(1, -1), positions, True)
    finally:
        for cache in caches:
            cache.set_peeking(False)
    for cache in caches:
        cache.finish_reconstruction()


def run_statistics(
    prompt_length: int, new_tokens: int, prefill_time: float, decode_time: float, caches, prefilled=None
) -> dict:
    """Speed and cache statistics of one run; n = prompt + new - 1 tokens passed through the cache.
    `prefilled`: the prompt tokens this run's prefill time covers, when not all of them."""
    prefilled = prompt_length if prefilled is None else prefilled
    return {
        "prompt_tokens": prompt_length,
        "prefilled_tokens": prefilled,
        "new_tokens": new_tokens,
        "prefill_time": prefill_time,
        "decode_time": decode_time,
        "prefill_tokens_per_s": prefilled / prefill_time,
        "decode_tokens_per_s": (new_tokens - 1) / decode_time if new_tokens > 1 else float("nan"),
        **cache_statistics(caches, prompt_length + new_tokens - 1),
    }


def decode_from(
    model: Transformer,
    logits: Tensor,
    start,
    max_new_tokens: int,
    steps: dict,
    terminator_ids=(),
    temperature: float = 0.0,
    top_k: int | None = None,
    callback=None,
    on_finish=None,
    generators=None,
) -> tuple[list[Tensor], list[float]]:
    """Samples up to max_new_tokens for each sequence of logits [B, vocab], the first from `logits`,
    the next by decode steps from position start[b] (an int when B = 1), stopping a sequence after a
    terminator. A finished sequence keeps stepping while others run (the step's shapes are fixed)
    and its later tokens are dropped; `on_finish(b, n_tokens, seconds)` sees it as it finishes,
    before another step changes its caches. `callback(token_id)` streams a single sequence's tokens;
    `generators` (one per sequence) sample it (see `sample`). Returns each sequence's tokens and decode
    seconds."""
    device = model.output.weight.device
    bsz = logits.shape[0]
    positions = torch.as_tensor(start, device=device).view(-1, 1)
    terminators = torch.tensor(list(terminator_ids) or [-1], device=device)
    next_token = sample(logits, temperature, top_k, generators)
    tokens, n_tokens, seconds = [next_token], [0] * bsz, [0.0] * bsz
    decode_start = time.perf_counter()
    for step in range(max_new_tokens):
        if step:
            logits = steps["decode"](model, next_token, positions + step - 1)
            next_token = sample(logits, temperature, top_k, generators)
            tokens.append(next_token)
        if callback:
            callback(int(next_token[0]))
        ended = torch.isin(next_token.view(-1), terminators).tolist()
        for b in range(bsz):
            if not n_tokens[b] and (ended[b] or step == max_new_tokens - 1):
                n_tokens[b], seconds[b] = step + 1, time.perf_counter() - decode_start
                if on_finish:
                    on_finish(b, step + 1, seconds[b])
        if all(n_tokens):
            break
    synchronize(device)
    tokens = torch.cat(tokens, dim=1)
    return [tokens[b, :n] for b, n in enumerate(n_tokens)], seconds


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: Tensor,
    max_new_tokens: int,
    cache_kwargs: dict,
    terminator_ids=(),
    temperature: float = 0.0,
    top_k: int | None = None,
    callback=None,
    steps: dict | None = None,
    context_length: int | None = None,
    on_context=None,
) -> tuple[Tensor, dict]:
    """Generates up to max_new_tokens after prompt_ids [T]; returns the new tokens and statistics.

    `steps` holds (possibly compiled) prefill/decode functions; `callback(token_id)` streams output;
    `context_length`: the prompt's first tokens are compressed before the rest is seen (context-only),
    and `on_context(caches)` sees the caches then (to save them).
    """
    sampling = {"terminator_ids": terminator_ids, "temperature": temperature, "top_k": top_k, "callback": callback}
    return generate_batch(
        model, [prompt_ids], max_new_tokens, cache_kwargs, **sampling, steps=steps, context_lengths=[context_length],
        on_context=on_context,
    )[0]  # fmt: skip


def join_row(caches: list, batch_caches: list, row: int) -> None:
    """Copies one sequence's caches (one per layer) into row `row` of the batch's, freeing its own."""
    for cache, batch_cache in zip(caches, batch_caches):
        cache.join_batch(batch_cache, row)


@torch.no_grad()
def generate_batch(
    model: Transformer,
    prompts: list[Tensor],
    max_new_tokens: int,
    cache_kwargs: dict,
    terminator_ids=(),
    temperature: float = 0.0,
    top_k: int | None = None,
    callback=None,
    steps: dict | None = None,
    context_lengths: list[int | None] | None = None,
    on_context=None,
    seeds: list[int] | None = None,
) -> list[tuple[Tensor, dict]]:
    """`generate` for several prompts of any lengths at once; returns (new tokens, statistics) per prompt.

    Each prompt is prefilled alone, into caches of its own size, compressed on its own (so no padding
    ever enters a cache); then its caches join one batch cache per layer as a row (the row's slots
    past its own size unallocated) and the sequences decode together, each at its own positions.
    Each prompt's statistics are its own, as if it ran alone; decode seconds run until it finished.
    `seeds`: a torch seed set before each prompt's prefill, and the seed of its own sampling generator,
    so that random eviction and sampling repeat alone.
    """
    steps = steps or STEPS
    device = model.output.weight.device
    prompts = [p.reshape(-1).to(device) for p in prompts]
    lengths = [p.numel() for p in prompts]
    context_lengths = context_lengths or [None] * len(prompts)
    batch_caches = None
    if len(prompts) > 1:  # the longest prompt sizes every layer's largest cache
        batch_caches = setup_caches(model, cache_kwargs, max(lengths), max_new_tokens, batch_size=len(prompts))
    logits, rows = [], []
    for b, (prompt, context_length) in enumerate(zip(prompts, context_lengths)):
        if seeds is not None:
            torch.manual_seed(seeds[b])
        last, caches, prefill_time = prefill_prompt(
            model, prompt, max_new_tokens, cache_kwargs, steps, context_length, on_context
        )
        if batch_caches is not None:
            join_row(caches, batch_caches, b)
        logits.append(last)
        rows.append((caches, prefill_time))
    if batch_caches is not None:
        model.setup_caches(batch_caches, max(lengths) + max_new_tokens)
    statistics = [None] * len(prompts)

    def finished(b: int, n_tokens: int, decode_time: float) -> None:
        caches, prefill_time = rows[b]
        statistics[b] = run_statistics(lengths[b], n_tokens, prefill_time, decode_time, caches)

    own_noise = seeds is not None and temperature > 0
    generators = [torch.Generator(device).manual_seed(seed) for seed in seeds] if own_noise else None
    sampling = (terminator_ids, temperature, top_k, callback, finished, generators)
    tokens, _ = decode_from(model, torch.cat(logits), torch.tensor(lengths), max_new_tokens, steps, *sampling)
    return list(zip(tokens, statistics))


@torch.no_grad()
def answer_questions(
    model: Transformer,
    context_ids: Tensor,
    questions: list[Tensor],
    max_new_tokens: int,
    cache_kwargs: dict,
    terminator_ids=(),
    steps: dict | None = None,
    question_room: int | None = None,
    seeds: list[int] | None = None,
):
    """Greedy answers to several questions about one context, compressed once (context-only).

    The context is prefilled and compressed with `question_room` slots kept free (default: the
    longest question's length), and its caches kept in memory; each question starts from them.
    Yields (new tokens, statistics) per question, as each finishes; the context's prefill time
    counts a 1/n share to each of the n answers. `seeds`: a torch seed set before each question,
    so that random eviction in an answer does not depend on which questions came before it.
    """
    steps = steps or STEPS
    device = model.output.weight.device
    context_ids = context_ids.reshape(-1).to(device)
    context_length = context_ids.numel()
    room = max(q.numel() for q in questions) if question_room is None else question_room
    caches = setup_caches(model, cache_kwargs, context_length + room, max_new_tokens)
    start = time.perf_counter()
    prefill_through(model, steps, context_ids, caches, cache_kwargs.get("prefill_chunk_size"), reserve=room)
    synchronize(device)
    context_share = (time.perf_counter() - start) / len(questions)
    compressed = cache_state(caches)
    for i, question in enumerate(questions):
        load_cache_state(caches, compressed)
        if seeds is not None:
            torch.manual_seed(seeds[i])
        yield answer_from(
            model, caches, context_length, question, max_new_tokens, cache_kwargs, steps, terminator_ids,
            context_prefill=(context_share, context_length / len(questions)),
        )  # fmt: skip


@torch.no_grad()
def answer_from(
    model: Transformer,
    caches: list,
    context_length: int,
    question: Tensor,
    max_new_tokens: int,
    cache_kwargs: dict,
    steps: dict,
    terminator_ids=(),
    temperature: float = 0.0,
    top_k: int | None = None,
    callback=None,
    context_prefill: tuple[float, float] = (0.0, 0.0),
) -> tuple[Tensor, dict]:
    """Prefills a question [Q] after the context the caches hold, then generates; returns the new
    tokens and statistics. `context_prefill`: (seconds, tokens) of the context's prefill counted in
    (a share when several questions use it; none when it was loaded from a file)."""
    device = model.output.weight.device
    question = question.reshape(-1).to(device)
    start = time.perf_counter()
    logits = prefill_through(model, steps, question, caches, cache_kwargs.get("prefill_chunk_size"), context_length)
    synchronize(device)
    prefill_time = context_prefill[0] + time.perf_counter() - start
    prompt_length = context_length + question.numel()
    sampling = (terminator_ids, temperature, top_k, callback)
    tokens, decode_time = decode_from(model, logits, prompt_length, max_new_tokens, steps, *sampling)
    tokens, decode_time = tokens[0], decode_time[0]
    prefilled = context_prefill[1] + question.numel()
    return tokens, run_statistics(prompt_length, len(tokens), prefill_time, decode_time, caches, prefilled)


@torch.no_grad()
def score_continuation(
    model: Transformer,
    prompt_ids: Tensor,
    continuation_ids: Tensor,
    cache_kwargs: dict,
    steps: dict | None = None,
    context_length: int | None = None,
) -> tuple[Tensor, dict]:
    """Natural-log probabilities [C] of each continuation token, teacher-forced through the cache.

    The prompt is prefilled as `generate` would; then the continuation is fed one token at a time
    through decode steps, so the cache strategy evicts exactly as it would while generating.
    Returns the log-probs (float32, on CPU) and the statistics `generate` reports.
    """
    steps = steps or STEPS
    device = model.output.weight.device
    prompt_ids = prompt_ids.reshape(-1).to(device)
    continuation_ids = continuation_ids.reshape(-1).to(device)
    prompt_length, n_cont = prompt_ids.numel(), continuation_ids.numel()
    if prompt_length < 1 or n_cont < 1:
        raise ValueError("score_continuation needs at least one prompt and one continuation token")
    logits, caches, prefill_time = prefill_prompt(model, prompt_ids, n_cont, cache_kwargs, steps, context_length)
    logprobs = [torch.log_softmax(logits.float(), dim=-1)[0, continuation_ids[0]]]
    decode_start = time.perf_counter()
    for i in range(n_cont - 1):
        x = continuation_ids[i].view(1, 1)
        logits = steps["decode"](model, x, torch.tensor([prompt_length + i], device=device))
        logprobs.append(torch.log_softmax(logits.float(), dim=-1)[0, continuation_ids[i + 1]])
    synchronize(device)
    decode_time = time.perf_counter() - decode_start
    return torch.stack(logprobs).cpu(), run_statistics(prompt_length, n_cont, prefill_time, decode_time, caches)
