"""Generate text for a prompt (or a file of prompts, in batches) with a chosen KV-cache strategy;
report speed, memory and cache statistics.

    python generate.py --prompt "What is a cold compress?"
    python generate.py --prompt long_niah.txt --cache_strategy heavy_hitter --max_cache_length 0.25 \
        --prompt_compression_strategy heavy_hitter
    python generate.py --prompts_file prompts.txt --batch_size 8 --cache_strategy l2 --max_cache_length 0.25
"""

import argparse
import csv
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

import strategies
import tp
from cache import check_value
from cache_args import (
    add_cache_arguments,
    add_tokenizer_kwargs,
    check_cache_lengths,
    check_compatibility,
    parse_args_with_cache_config,
)
from generation import (
    BACKENDS,
    DEFAULT_CHECKPOINT,
    STEPS,
    CheckpointError,
    answer_from,
    check_output_path,
    checkpoint_config,
    compile_steps,
    generate,
    generate_batch,
    load_model,
    peak_memory_bytes,
    resolve_device,
    resolve_dtype,
    setup_caches,
    torch_profile,
)
from saved_context import check_header, describe, load_context, read_header, save_context
from tokenizer import get_tokenizer

PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
DEFAULT_PROMPT = "What is a cold compress?"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default=None,
                        help=f"a prompt string, or NAME.txt from prompts/ (default: {DEFAULT_PROMPT!r})")  # fmt: skip
    parser.add_argument("--question", default=None,
                        help="a question about the prompt, which is then its context; both go in one user turn "
                        "(default: none)")  # fmt: skip
    parser.add_argument("--save_cache", type=Path, default=None,
                        help="write the prompt's compressed cache (context-only) to FILE, then answer --question "
                        "(default: none)")  # fmt: skip
    parser.add_argument("--load_cache", type=Path, default=None,
                        help="start from a cache written by --save_cache and answer --question; takes no --prompt "
                        "(default: none)")  # fmt: skip
    parser.add_argument("--prompts_file", type=Path, default=None,
                        help="prompts from a file, one per line (or a .jsonl file with a \"prompt\" field per line); "
                        "each gets its output and statistics (default: none)")  # fmt: skip
    parser.add_argument("--batch_size", type=int, default=1,
                        help="prompts of --prompts_file decoded together (default: %(default)s)")  # fmt: skip
    parser.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT,
                        help="converted checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")  # fmt: skip
    parser.add_argument("--max_new_tokens", type=int, default=256,
                        help="most tokens to generate; stops earlier at an end token (default: %(default)s)")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: 0)")
    parser.add_argument("--top_k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    parser.add_argument(
        "--seed", type=int, default=0, help="makes sampling and random eviction repeatable (default: 0)"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="auto: the CPU back-end's kernels on CPU (`make cpu-kernels` builds its C++ ones); "
                        "none: the plain model (default: %(default)s)")  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32 (default: bfloat16)")
    parser.add_argument("--no_chat_template", action="store_true", help="feed the prompt as raw text (default: off)")
    parser.add_argument("--compile", action="store_true", help="torch.compile prefill and decode (default: off)")
    parser.add_argument("--csv", type=Path, default=None,
                        help="append one row of statistics and arguments to this file (default: none)")  # fmt: skip
    parser.add_argument("--profile", type=Path, default=None,
                        help="write a torch profiler chrome trace of the run to this file (default: none)")  # fmt: skip
    add_cache_arguments(parser)
    return parser


def read_prompt(prompt: str) -> str:
    if prompt.endswith(".txt") and "\n" not in prompt:
        path = Path(prompt) if Path(prompt).is_file() else PROMPT_DIR / prompt
        if not path.is_file():
            names = ", ".join(sorted(p.name for p in PROMPT_DIR.glob("*.txt")))
            raise ValueError(f"prompt file '{prompt}' not found in {PROMPT_DIR}; choose from: {names}")
        prompt = read_text(path, "prompt file")
    if not prompt.strip():
        raise ValueError("the prompt is empty; pass --prompt TEXT or --prompt NAME.txt")
    return prompt


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path} ({e.strerror}); give a readable text file") from None


def read_prompts_file(path: Path) -> list[str]:
    """One prompt per non-empty line, or, in a .jsonl file, one JSON object with a "prompt" per line."""
    if not path.is_file():
        raise ValueError(f"prompts file {path} not found; pass a file with one prompt per line")
    lines = [(n, line) for n, line in enumerate(read_text(path, "prompts file").splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"prompts file {path} holds no prompt; write one prompt per line")
    if path.suffix != ".jsonl":
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ValueError(f'{path} line {n} is not a JSON object with a "prompt" text; write {{"prompt": "..."}}')
        prompts.append(record["prompt"])
    return prompts


def check_batch_flags(args) -> None:
    """A prompts file brings its own prompts and runs plain generation, one process."""
    check_value("--batch_size", args.batch_size, minimum=1)
    if args.prompts_file is None:
        if args.batch_size > 1:
            raise ValueError("--batch_size needs --prompts_file (the prompts to batch)")
        return
    if args.prompt is not None:
        raise ValueError("--prompts_file and --prompt exclude each other; put the prompt in the file")
    for flag in ("question", "save_cache", "load_cache", "context_only"):
        if getattr(args, flag):
            raise ValueError(f"--prompts_file runs plain prompts; drop --{flag}")
    if tp.world_size() > 1:
        raise ValueError("--prompts_file runs on one process; drop torchrun")


def check_question_flags(args) -> None:
    """The flags that need a question, and those that exclude each other."""
    if args.question is not None and not args.question.strip():
        raise ValueError("the question is empty; pass --question TEXT")
    for flag in ("context_only", "save_cache", "load_cache"):
        if getattr(args, flag) and args.question is None:
            raise ValueError(f"--{flag} needs --question (the prompt is then the context)")
    if args.save_cache and args.load_cache:
        raise ValueError("--save_cache and --load_cache exclude each other; save in one run, load in the next")
    if args.load_cache and args.prompt is not None:
        raise ValueError("--load_cache takes no --prompt: the context comes from the file")
    if (args.save_cache or args.load_cache) and tp.world_size() > 1:
        raise ValueError("--save_cache and --load_cache run on one process; drop torchrun")


def encode_prompt(tokenizer, prompt: str, question: str | None, raw: bool) -> tuple[torch.Tensor, int]:
    """Prompt token ids (the question after the context, in one user turn) and how many of them are
    the context: the context is tokenized on its own, so it ends on a token boundary."""
    turn = prompt if question is None else f"{prompt}\n\n{question}"
    text = turn if raw else tokenizer.apply_chat_template(turn)
    if question is None:
        ids = tokenizer.encode(text)
        return torch.tensor(ids, dtype=torch.long), len(ids)
    ids, context_length = tokenizer.encode_split(text, text.index(turn) + len(prompt))
    return torch.tensor(ids, dtype=torch.long), context_length


def question_after_saved_context(tokenizer, question: str, raw: bool) -> torch.Tensor:
    """The tokens that follow a context in the prompt: the question and the template's tail, which
    do not depend on the context's text."""
    ids, context_length = encode_prompt(tokenizer, "context", question, raw)
    return ids[context_length:]


def check_saved_context(args, header: dict, question_length: int, block_size: int) -> None:
    """The question and --max_new_tokens must fit after the saved context: the model's context, and
    the cache, where it spans the whole sequence."""
    total = header["context_tokens"] + question_length + args.max_new_tokens
    if total > block_size:
        raise ValueError(
            f"saved context of {header['context_tokens']} tokens + question of {question_length} + "
            f"{args.max_new_tokens} new tokens exceeds the model's context of {block_size}; lower --max_new_tokens"
        )
    room = header["question_room"] + header["max_new_tokens"]
    if question_length + args.max_new_tokens > room and any(
        strategies.strategy_class(name).spans_sequence for name in args.cache_strategy
    ):
        raise ValueError(
            f"the saved cache has room for {room} tokens after its context; this question ({question_length}) and "
            f"--max_new_tokens {args.max_new_tokens} need more; lower --max_new_tokens or save with a longer question"
        )


def caches_from_file(model, cache_kwargs: dict, header: dict, path: Path, sequence_length: int) -> list:
    """Caches built for the sizes the file was saved with, filled from it."""
    context_length = header["context_tokens"]
    caches = setup_caches(model, cache_kwargs, context_length + header["question_room"], header["max_new_tokens"])
    sized = context_length + header["question_room"] + header["max_new_tokens"]
    model.setup_caches(caches, max(sized, sequence_length))
    load_context(path, caches)
    return caches


# Printed first, in their own words; every other statistic the caches report follows by name.
SPEED_AND_SIZE = (
    "prompt_tokens",
    "prefilled_tokens",
    "new_tokens",
    "prefill_time",
    "decode_time",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "total_time",
    "peak_memory_bytes",
    "compression_ratio",
    "cache_memory_bytes",
    "compression_ratio_per_layer",
    "cache_memory_bytes_per_layer",
    "kept_memory_bytes",
)


def print_statistics(stats: dict) -> None:
    loaded = stats["prompt_tokens"] - round(stats["prefilled_tokens"])
    after = f" after a loaded context of {loaded}" if loaded else ""
    print(f"\nprefill: {round(stats['prefilled_tokens'])} tokens{after}, {stats['prefill_tokens_per_s']:.1f} tokens/s")
    print(f"decode: {stats['new_tokens']} tokens, {stats['decode_tokens_per_s']:.1f} tokens/s")
    print(f"total time: {stats['total_time']:.2f} s, peak memory: {stats['peak_memory_bytes'] / 2**20:.1f} MiB")
    kept = stats.get("kept_memory_bytes")
    of_which = "" if kept is None else f" allocated, {kept / 2**20:.2f} MiB of it kept (heads hold different counts)"
    print(
        f"compression ratio: {stats['compression_ratio']:.4f}, "
        f"cache memory: {stats['cache_memory_bytes'] / 2**20:.2f} MiB{of_which}"
    )
    ratios = " ".join(f"{r:.3f}" for r in stats["compression_ratio_per_layer"])
    print(f"compression ratio per layer: {ratios}")
    memory = " ".join(f"{m / 2**10:.0f}" for m in stats["cache_memory_bytes_per_layer"])
    print(f"cache memory per layer (KiB): {memory}")
    for key, value in stats.items():
        if key not in SPEED_AND_SIZE:
            print(f"{key.replace('_', ' ')}: {format_statistic(value)}")


def format_statistic(value) -> str:
    """A number to 4 decimals, a list of numbers per layer, a dict (e.g. shares) as name=value."""
    if isinstance(value, dict):
        return ", ".join(f"{name} {format_statistic(v)}" for name, v in value.items())
    if isinstance(value, list):
        return " ".join(f"[{format_statistic(v)}]" if isinstance(v, dict) else format_statistic(v) for v in value)
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def append_csv(path: Path, stats: dict, args: argparse.Namespace) -> None:
    """Appends a row under the file's header. A row with a column the header lacks (a prompts-file
    run's prompt_index after single runs, a strategy's own statistic) rewrites the file atomically
    with those columns added at the end: earlier rows keep their values where they were. Runs that
    share a folder take turns (a lock on the folder), so that none appends to a file being replaced."""
    import fcntl

    row = {k: json.dumps(v) if isinstance(v, list) else v for k, v in {**stats, **vars(args)}.items()}
    row = {k: str(v) if isinstance(v, Path) else v for k, v in row.items()}
    path = path.resolve()  # a link stays a link to the rewritten file
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        lines = []
        if path.is_file() and path.stat().st_size > 0:
            with path.open(newline="") as f:
                lines = list(csv.reader(f))
        header = lines[0] if lines else []
        if header and row.keys() <= set(header):
            with path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=header).writerow(row)
            return
        header = header + [k for k in row if k not in header]
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with partial.open("w", newline="") as f:
                csv.writer(f).writerows([header, *lines[1:]])
                csv.DictWriter(f, fieldnames=header).writerow(row)
            if path.is_file():
                shutil.copymode(path, partial)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    finally:
        os.close(folder)


def check_prompt_fits(args, cache_kwargs: dict, config, prompt_length: int, question_length: int = 0) -> None:
    if prompt_length + args.max_new_tokens > config.block_size:
        raise ValueError(
            f"prompt of {prompt_length} tokens + {args.max_new_tokens} new tokens exceeds the model's "
            f"context of {config.block_size}; shorten the prompt or lower --max_new_tokens"
        )
    check_cache_lengths(cache_kwargs, config.n_layer, prompt_length, args.max_new_tokens, question_length)


def generate_prompts_file(args, model, tokenizer, cache_kwargs: dict, steps: dict, prompts: list) -> None:
    """Generates for the prompts in batches of --batch_size; prints each output with its statistics
    (a csv row each), then the throughput over all batches. Prompt i's sampling and random eviction
    are seeded with --seed + i, so it samples and evicts the same whatever the batch size."""
    device = model.output.weight.device
    sampling = {"terminator_ids": tokenizer.terminator_ids, "temperature": args.temperature, "top_k": args.top_k}
    prefill_time = decode_time = 0.0
    decoded = 0  # tokens from decode steps: each prompt's first comes from its prefill
    start = time.perf_counter()
    for first in range(0, len(prompts), args.batch_size):
        batch = prompts[first : first + args.batch_size]
        seeds = [args.seed + first + b for b in range(len(batch))]
        results = generate_batch(model, batch, args.max_new_tokens, cache_kwargs, **sampling, steps=steps, seeds=seeds)
        decode_time += max(stats["decode_time"] for _, stats in results)  # the batch decodes together
        for b, (tokens, stats) in enumerate(results):
            prefill_time += stats["prefill_time"]
            decoded += stats["new_tokens"] - 1
            stats["total_time"] = stats["prefill_time"] + stats["decode_time"]
            stats["peak_memory_bytes"] = peak_memory_bytes(device)
            text = tokenizer.decode_answer(tokens)
            print(f"\n--- prompt {first + b + 1} of {len(prompts)} ---\n{text}")
            print_statistics(stats)
            if args.csv:
                append_csv(args.csv, {"prompt_index": first + b + 1, **stats}, args)
    prefilled = sum(ids.numel() for ids in prompts)
    decode_rate = decoded / decode_time if decoded else float("nan")
    print(
        f"\n{len(prompts)} prompts in batches of {args.batch_size}: prefill {prefilled / prefill_time:.1f} tokens/s, "
        f"decode {decode_rate:.1f} tokens/s over the batch, total time {time.perf_counter() - start:.2f} s"
    )


def main(argv=None) -> None:
    parser = build_parser()
    args = parse_args_with_cache_config(parser, argv)
    rank = tp.env_rank()  # > 0 only on the other ranks of a tensor-parallel torchrun launch
    if rank:
        sys.stdout = open(os.devnull, "w")  # only rank 0 prints
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype)
        check_value("--max_new_tokens", args.max_new_tokens, minimum=1)
        check_value("--temperature", args.temperature, minimum=0)
        if args.top_k is not None:
            check_value("--top_k", args.top_k, minimum=1)
        check_question_flags(args)
        check_batch_flags(args)
        args.context_only = args.context_only or bool(args.save_cache or args.load_cache)
        if args.prompts_file:
            texts = read_prompts_file(args.prompts_file)
        elif not args.load_cache:
            prompt = read_prompt(DEFAULT_PROMPT if args.prompt is None else args.prompt)
        check_output_path(args.profile, "--profile")
        check_output_path(args.csv, "--csv")
        check_output_path(args.save_cache, "--save_cache")
        config = checkpoint_config(args.checkpoint_path)
        if tp.world_size() > 1:
            tp.check_tp(config, tp.world_size())
            device = tp.local_device(device)
        cache_kwargs = {k: v for k, v in vars(args).items()}
        check_compatibility(cache_kwargs, config.n_layer, compile=args.compile)
        setup = describe(config, args.checkpoint_path, args.dtype, cache_kwargs)
        tokenizer = get_tokenizer(args.checkpoint_path)
        cache_kwargs = add_tokenizer_kwargs(cache_kwargs, tokenizer)
        raw = args.no_chat_template or not tokenizer.is_chat
        if args.load_cache:
            header = read_header(args.load_cache)
            check_header(args.load_cache, header, setup)
            prompt_ids = question_after_saved_context(tokenizer, args.question, raw)
            check_saved_context(args, header, prompt_ids.numel(), config.block_size)
        elif args.prompts_file:
            batch_ids = [encode_prompt(tokenizer, text, None, raw)[0] for text in texts]
            for n, ids in enumerate(batch_ids, 1):
                try:
                    check_prompt_fits(args, cache_kwargs, config, ids.numel())
                except ValueError as e:
                    raise ValueError(f"prompt {n} of {args.prompts_file}: {e}") from None
        else:
            prompt_ids, context_length = encode_prompt(tokenizer, prompt, args.question, raw)
            question_length = prompt_ids.numel() - context_length if args.context_only else 0
            check_prompt_fits(args, cache_kwargs, config, prompt_ids.numel(), question_length)
        shard = tp.apply_tp if tp.maybe_init_dist(device) is not None else None
        model = load_model(args.checkpoint_path, device, dtype, shard=shard, backend=args.backend)
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        sys.exit(f"error: {e}" if not rank else 1)

    torch.manual_seed(args.seed)
    steps = compile_steps(STEPS, device) if args.compile else STEPS
    if args.prompts_file:
        with torch_profile(args.profile, device, "generate"):
            generate_prompts_file(args, model, tokenizer, cache_kwargs, steps, batch_ids)
        return
    streamed = []

    def stream(token: int) -> None:
        """Prints the text decoded so far, minus what was already printed (multi-byte safe)."""
        streamed.append(token)
        if token not in tokenizer.terminator_ids:
            text_so_far = tokenizer.decode_answer(streamed)
            print(text_so_far[stream.printed :], end="", flush=True)
            stream.printed = len(text_so_far)

    stream.printed = 0
    start = time.perf_counter()
    sampling = {"terminator_ids": tokenizer.terminator_ids, "temperature": args.temperature, "top_k": args.top_k}
    with torch_profile(None if rank else args.profile, device, "generate"):
        if args.load_cache:
            sequence_length = header["context_tokens"] + prompt_ids.numel() + args.max_new_tokens
            caches = caches_from_file(model, cache_kwargs, header, args.load_cache, sequence_length)
            context_length = header["context_tokens"]
            _, stats = answer_from(
                model, caches, context_length, prompt_ids, args.max_new_tokens, cache_kwargs, steps, **sampling,
                callback=stream,
            )  # fmt: skip
        else:

            def save(caches):
                question_room = prompt_ids.numel() - context_length
                save_context(args.save_cache, caches, setup, context_length, question_room, args.max_new_tokens)

            _, stats = generate(
                model, prompt_ids, args.max_new_tokens, cache_kwargs, **sampling, callback=stream, steps=steps,
                context_length=context_length if args.context_only else None,
                on_context=save if args.save_cache else None,
            )  # fmt: skip
    stats = tp.all_reduce_statistics(stats)  # whole-model cache statistics under tensor parallel
    stats["total_time"] = time.perf_counter() - start
    stats["peak_memory_bytes"] = peak_memory_bytes(device)
    print()
    print_statistics(stats)
    if args.csv and not rank:
        append_csv(args.csv, stats, args)
    tp.maybe_destroy_dist()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
