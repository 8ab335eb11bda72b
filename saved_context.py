"""A compressed context on disk: compress once, ask later.

One safetensors file: every layer's cache buffers as tensors, and in its header (JSON) the model, the
cache settings and the sizes the caches were built for, so that a file from another model or
configuration is refused before anything runs, and loading rebuilds the very same caches.
"""

import dataclasses
import json
import os
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cache import cache_state, load_cache_state
from cache_args import relevant_kwargs

FORMAT = "kv-workbench-context/1"
SAME_FOR_EVERY_QUESTION = ("prefill_chunk_size", "context_only")  # how the question is fed: free on load


def describe(config, checkpoint: Path, dtype: str, cache_kwargs: dict) -> dict:
    """What a saved context depends on: the model, its dtype and the cache settings."""
    settings = {k: v for k, v in relevant_kwargs(cache_kwargs).items() if k not in SAME_FOR_EVERY_QUESTION}
    return json.loads(
        json.dumps(
            {
                "checkpoint": Path(checkpoint).name,
                "model": dataclasses.asdict(config),
                "dtype": dtype,
                "cache": settings,
            }
        )
    )


def save_context(path: Path, caches: list, setup: dict, context_tokens: int, question_room: int, new_tokens: int):
    """Writes the caches after the context (atomically: a temporary file, then a rename)."""
    header = {
        "format": FORMAT,
        **setup,
        "context_tokens": context_tokens,
        "question_room": question_room,
        "max_new_tokens": new_tokens,
    }
    tensors = {
        f"{layer}.{name}": t.contiguous()
        for layer, state in enumerate(cache_state(caches))
        for name, t in state.items()
    }
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    save_file(tensors, str(partial), metadata={"context": json.dumps(header)})
    os.replace(partial, path)


def read_header(path: Path) -> dict:
    """The header of a saved context; ValueError for a missing, corrupt or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--load_cache {path} not found; save one first with --save_cache")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {})["context"])
    except Exception as e:  # safetensors and json raise several types for a truncated or foreign file
        raise ValueError(f"--load_cache {path} is not a saved context or is corrupt ({type(e).__name__})") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"--load_cache {path} has format {header.get('format')!r}; this version reads {FORMAT}")
    return header


def check_header(path: Path, header: dict, setup: dict) -> None:
    """Refuses a context saved for another checkpoint, model, dtype or cache settings, in one line."""
    if header["checkpoint"] != setup["checkpoint"] or header["model"] != setup["model"]:
        raise ValueError(f"--load_cache {path} was saved from {header['checkpoint']}; load that checkpoint")
    if header["dtype"] != setup["dtype"]:
        raise ValueError(f"--load_cache {path} was saved in {header['dtype']}; pass --dtype {header['dtype']}")
    if header["cache"] != setup["cache"]:
        raise ValueError(f"--load_cache {path} was saved with other cache settings; pass: {as_flags(header['cache'])}")


def as_flags(settings: dict) -> str:
    """Cache settings as the command-line flags that give them."""
    flags = []
    for name, value in settings.items():
        if value is True:
            flags.append(f"--{name}")
        elif value not in (None, False):
            flags.append(f"--{name} {' '.join(map(str, value)) if isinstance(value, list) else value}")
    return " ".join(flags)


def load_context(path: Path, caches: list) -> None:
    """Fills caches built for the header's sizes with the saved buffers."""
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise ValueError(f"--load_cache {path} is corrupt ({type(e).__name__}); save it again") from None
    state = [{} for _ in caches]
    for key, t in tensors.items():
        layer, name = key.split(".", 1)
        if int(layer) >= len(state):
            raise ValueError(f"--load_cache {path} holds layer {layer}; the model has {len(caches)}")
        state[int(layer)][name] = t
    try:
        load_cache_state(caches, state)
    except ValueError as e:
        raise ValueError(f"--load_cache {path} does not fit these caches: {e}") from None
