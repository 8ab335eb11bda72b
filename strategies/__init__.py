"""The strategy registry: every KV-cache strategy, one module each, and the per-layer cache factory.

Flags, presets' keys, result-folder names, compatibility checks, `debug_<name>`, the sweeps' and the
benchmark's compressor for each strategy, and the tests' matrix all come from this dict and the
facts each class (and its prompt compressor) declares. Adding a strategy is one module, one line here
and a preset.
"""

import math

import torch

from cache import (
    HEAD_CAPACITY,
    SHARED_PARAMS,
    KVCache,
    Param,
    layer_cache_lengths,
    layer_strategies,
    resolve_recent_window,
)
from prompt_compression import PromptCompressor
from strategies.debug import DebugCache
from strategies.expected_attention import ExpectedAttentionCache
from strategies.full import FullCache
from strategies.heavy_hitter import HeavyHitterCache
from strategies.hybrid import HybridCache
from strategies.keep_it_odd import KeepItOddCache
from strategies.keydiff import KeyDiffCache
from strategies.kvzip import KVzipCache
from strategies.l2 import L2Cache
from strategies.random import RandomCache
from strategies.recent_global import RecentGlobalCache
from strategies.tova import TovaCache

STRATEGIES: dict[str, type[KVCache]] = {
    "full": FullCache,
    "recent_global": RecentGlobalCache,
    "random": RandomCache,
    "l2": L2Cache,
    "heavy_hitter": HeavyHitterCache,
    "keep_it_odd": KeepItOddCache,
    "hybrid": HybridCache,
    "tova": TovaCache,
    "keydiff": KeyDiffCache,
    "expected_attention": ExpectedAttentionCache,
    "kvzip": KVzipCache,
}
DEFAULT_STRATEGY = "full"
DEFAULT_COMPRESSOR = "recent_global"
DEBUG_PREFIX = "debug_"


def strategy_names(debug: bool = False) -> list[str]:
    """Registered names, and with `debug` each one's `debug_<name>` too."""
    return list(STRATEGIES) + ([DEBUG_PREFIX + n for n in STRATEGIES] if debug else [])


def strategy_class(name: str) -> type[KVCache]:
    """The class a name stands for; `debug_<name>` stands for `<name>`'s class (its facts decide)."""
    base = name.removeprefix(DEBUG_PREFIX)
    if base not in STRATEGIES:
        raise ValueError(f"unknown cache strategy '{name}'; choose from: {', '.join(STRATEGIES)} or debug_<name>")
    return STRATEGIES[base]


def compressors() -> dict[str, type[PromptCompressor]]:
    """Prompt compressors by name: each strategy's own, under the strategy's name and its own `name`."""
    found = {}
    for name, cls in STRATEGIES.items():
        compressor = cls.prompt_compressor_class
        if compressor is not None:
            found[name] = compressor
            found.setdefault(compressor.name or name, compressor)
    return found


def compressor_class(name: str) -> type[PromptCompressor]:
    found = compressors()
    if name not in found:
        raise ValueError(f"unknown prompt compression strategy '{name}'; choose from: {', '.join(found)}")
    return found[name]


def natural_compressor(name: str) -> str:
    """The prompt compressor that goes with a strategy in sweeps and benchmarks."""
    return strategy_class(name).natural_compressor or DEFAULT_COMPRESSOR


def compatible_compressors(name: str) -> list[str]:
    """The compressors a strategy takes: head-specific ones only with a head-specific cache."""
    head_specific = strategy_class(name).head_specific
    return [n for n, c in compressors().items() if head_specific or not c.head_specific]


def ranks_heads_apart(name: str, compressor: str) -> bool:
    """Whether a layer of strategy `name` with `compressor` can share its budget among its heads
    (adaptive head budgets): its compressor, or the cache itself (kvzip), scores each head apart;
    a cache that never compresses has nothing to share and qualifies too."""
    cls = strategy_class(name)
    return cls.spans_sequence or cls.reconstructs_context or compressor_class(compressor).head_specific


def compressing_strategies() -> list[str]:
    """The strategies that compress by evicting: the sweeps' default list."""
    return [n for n, c in STRATEGIES.items() if not c.spans_sequence]


def baseline_strategies() -> list[str]:
    """The strategies that keep every token: results are compared against these."""
    return [n for n, c in STRATEGIES.items() if c.baseline]


def hyperparameters() -> list[Param]:
    """Every hyper-parameter a registered strategy or prompt compressor reads, shared ones first; one
    per name."""
    params = {p.name: p for p in SHARED_PARAMS}
    for name, cls in [*STRATEGIES.items(), *compressors().items()]:
        for p in cls.params:
            if p.name in params and params[p.name] != p:
                raise ValueError(f"'{name}' redeclares --{p.name} differently; share one Param")
            params[p.name] = p
    return list(params.values())


def param_users(param: Param) -> list[str]:
    """The strategies and compressors that read a hyper-parameter of their own."""
    users = [n for n, c in STRATEGIES.items() if param in c.params]
    return users + [n for n, c in compressors().items() if param in c.params and n not in users]


def new_cache(
    name: str, compressor: str, shape: tuple, length: int, seq_len: int, dtype, cache_kwargs: dict
) -> KVCache:
    """One layer's cache of strategy `name` ([batch, KV heads, head dim] `shape`, `length` slots)
    with prompt compressor `compressor`; `debug_<name>` spans `seq_len` and simulates `<name>`."""
    kwargs = {p.name: cache_kwargs[p.name] for p in hyperparameters() if p.name in cache_kwargs}
    kwargs.update(cache_kwargs.get("tokenizer_kwargs") or {})
    compressor_cls = compressor_class(compressor)
    kwargs["prompt_compressor"] = compressor_cls(
        global_tokens=kwargs["global_tokens"],
        recent_window=resolve_recent_window(kwargs["recent_window"], length, kwargs["global_tokens"]),
        **{p.name: kwargs[p.name] for p in compressor_cls.params if p.name in kwargs},
    )
    adaptive = kwargs.get("head_budgets") == "adaptive"
    capacity = min(seq_len, 8 * math.ceil(HEAD_CAPACITY * length / 8)) if adaptive else None
    cache = strategy_class(name)(*shape[:2], shape[2], length, dtype, capacity=capacity, **kwargs)
    if name.startswith(DEBUG_PREFIX):
        return DebugCache(*shape[:2], shape[2], seq_len, dtype, simulated=cache, **kwargs)
    return cache


def window_cache(window: int, shape: tuple, seq_len: int, dtype, cache_kwargs: dict) -> KVCache:
    """A sliding-window layer's cache: its most recent min(window, seq_len) tokens, which is all its
    queries ever see, so it is exact (recent_global without global tokens). The user's strategy and
    budget serve the global layers; only the storage (--cache_bits) applies here too."""
    kwargs = {
        **cache_kwargs,
        "global_tokens": 0,
        "recent_window": 0,
        "head_budgets": "uniform",
        "tokenizer_kwargs": None,
    }
    cache = new_cache("recent_global", "recent_global", shape, min(window, seq_len), seq_len, dtype, kwargs)
    cache.window = window
    return cache


def create_caches(
    cache_kwargs: dict,
    n_layer: int,
    n_heads: int,
    head_dim: int,
    prompt_length: int,
    max_new_tokens: int,
    device,
    dtype: torch.dtype,
    max_batch_size: int = 1,
    windows: list[int | None] | None = None,
) -> list[KVCache]:
    """One cache per layer, sized and typed by the per-layer patterns; a sliding-window layer (its
    `windows` entry not None) gets the model's own cache instead, `window_cache`."""
    lengths = layer_cache_lengths(cache_kwargs, n_layer, prompt_length, max_new_tokens)
    seq_len = prompt_length + max_new_tokens
    caches = []
    windows = windows or [None] * n_layer
    for length, (strategy, compressor), window in zip(lengths, layer_strategies(cache_kwargs, n_layer), windows):
        if window is not None:
            cache = window_cache(window, (max_batch_size, n_heads, head_dim), seq_len, dtype, cache_kwargs)
            caches.append(cache.to(device))
            continue
        if length <= cache_kwargs["global_tokens"]:
            raise ValueError(f"--global_tokens {cache_kwargs['global_tokens']} exceeds a cache of {length} slots")
        cache = new_cache(
            strategy, compressor, (max_batch_size, n_heads, head_dim), length, seq_len, dtype, cache_kwargs
        )
        caches.append(cache.to(device))
    return caches
