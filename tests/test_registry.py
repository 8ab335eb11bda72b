"""The strategy registry drives everything: each test here iterates it, so a newly registered
strategy is covered with no edit. On the tiny random model: every strategy (and its debug_ twin) at
budget 1.0 reproduces the full cache, every strategy runs with every compressor it accepts, every
preset loads and generates; a strategy registered at run time shows up in --help, the rules and the
matrix."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_prompt, tiny_transformer

import generate
import generation
import strategies
from cache import KVCache, Param
from cache_args import CACHE_CONFIG_DIR, check_compatibility, default_cache_kwargs, load_cache_config, relevant_kwargs
from prompt_compression import PromptCompressor

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LENGTH, NEW_TOKENS = 40, 12


def lossless_kwargs(name: str) -> dict:
    """Cache arguments at budget 1.0 with the strategy's natural compressor and lossless settings."""
    cls = strategies.strategy_class(name)
    return default_cache_kwargs(
        cache_strategy=[name],
        prompt_compression_strategy=[strategies.natural_compressor(name)],
        max_cache_length=[1.0],
        **cls.lossless_kwargs(),
    )


def matrix() -> list[tuple[str, str]]:
    """Every registered strategy with every prompt compressor it accepts, each compressor class under
    one name (one that keeps the whole prompt only where the cache spans the sequence: elsewhere the
    prompt outgrows it)."""
    names = {}
    for name, cls in strategies.compressors().items():
        names.setdefault(cls, name)
    return [
        (name, c)
        for name, cls in strategies.STRATEGIES.items()
        for c in strategies.compatible_compressors(name)
        if c in names.values() and (cls.spans_sequence or strategies.compressor_class(c).compresses)
    ]


def pairs() -> list[tuple[str, str]]:
    """Every strategy once (with its natural compressor) and every compressor once (with the first
    strategy of the matrix that takes it, one that compresses where any does): for checks that repeat
    per chunk size or question, where the whole matrix would repeat the same check."""
    chosen = [(name, strategies.natural_compressor(name)) for name in strategies.STRATEGIES]
    for name, compressor in sorted(matrix(), key=lambda pair: strategies.strategy_class(pair[0]).spans_sequence):
        if compressor not in {c for _, c in chosen}:
            chosen.append((name, compressor))
    return chosen


def names_and_some_debug() -> list[str]:
    """Every registered strategy, and the debug_ twins of one that records attention and one that
    scores by a reconstruction pass: each debug_ twin is checked on its own in this file, so the
    tests that repeat a check per strategy need not take them all."""
    return strategies.strategy_names() + ["debug_heavy_hitter", "debug_kvzip"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_transformer(seed=0)


def tiny_generate(model, cache_kwargs: dict, prompt_length: int = PROMPT_LENGTH) -> tuple[list[int], dict]:
    check_compatibility(cache_kwargs, model.config.n_layer)
    torch.manual_seed(0)
    tokens, stats = generation.generate(model, tiny_prompt(prompt_length, seed=3), NEW_TOKENS, cache_kwargs)
    return tokens.tolist(), stats


@pytest.fixture(scope="module")
def full_tokens(tiny):
    return tiny_generate(tiny, lossless_kwargs(strategies.DEFAULT_STRATEGY))[0]


@pytest.mark.parametrize("name", strategies.strategy_names(debug=True))
def test_every_strategy_at_budget_one_reproduces_the_full_cache(name, tiny, full_tokens):
    tokens, stats = tiny_generate(tiny, lossless_kwargs(name))
    assert tokens == full_tokens
    assert stats["compression_ratio"] == 0.0


@pytest.mark.parametrize(("name", "compressor"), matrix())
def test_every_strategy_runs_with_every_compressor_it_accepts(name, compressor, tiny):
    """A 40-token prompt into caches half as long (a whole-sequence strategy keeps its length):
    the compressor chooses, the cache stays within its slots and holds no position twice."""
    check_strategy_with_compressor(tiny, name, compressor)


def check_strategy_with_compressor(model, name: str, compressor: str) -> None:
    spans = strategies.strategy_class(name).spans_sequence
    kwargs = default_cache_kwargs(
        cache_strategy=[name],
        prompt_compression_strategy=[compressor],
        max_cache_length=[1.0 if spans else 0.5],
        global_tokens=2,
        recent_window=4,
    )
    tokens, stats = tiny_generate(model, kwargs)
    assert len(tokens) == NEW_TOKENS
    for layer in model.layers:
        cache = layer.attention.kv_cache
        assert isinstance(cache, strategies.STRATEGIES[name])
        for head_pos in cache.pos[0].tolist():
            held = [p for p in head_pos if p >= 0]
            assert len(held) == len(set(held)) <= cache.max_cache_length
            assert {0, 1} <= set(held), "global tokens are never evicted"
    assert 0.0 <= stats["compression_ratio"] < 1.0


def test_every_strategy_has_a_preset_and_every_preset_runs(tiny):
    presets = sorted(CACHE_CONFIG_DIR.glob("*.yaml"))
    assert {p.stem for p in presets} >= set(strategies.STRATEGIES)
    for path in presets:
        config = load_cache_config(path.stem)
        kwargs = default_cache_kwargs(**config)
        tokens, _ = tiny_generate(tiny, kwargs, prompt_length=200)  # long enough for every preset's budget
        assert len(tokens) == NEW_TOKENS, path.name


class Throwaway(KVCache):
    """Registered only inside a test: keeps the tokens with the largest key sum."""

    name = "throwaway"
    params = (Param("throwaway_weight", float, 1.0, "how much the key sum counts", above=0),)

    def __init__(self, *args, throwaway_weight=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.throwaway_weight = throwaway_weight
        self.register_buffer("key_sum", torch.zeros(self.pos.shape))

    def score(self, key_pos, k, v, query, query_pos):
        return self.key_sum.mean(1, keepdim=True) * self.throwaway_weight

    def insert_state(self, slots, k, state):
        self.write_slots(self.key_sum, slots, k.float().sum(-1))


def test_a_strategy_registered_at_run_time_is_everywhere(monkeypatch, tiny, full_tokens):
    monkeypatch.setitem(strategies.STRATEGIES, "throwaway", Throwaway)
    help_text = " ".join(generate.build_parser().format_help().split())
    assert "throwaway" in help_text and "--throwaway_weight" in help_text
    assert "throwaway: how much the key sum counts (default: 1.0)" in help_text
    assert ("throwaway", "recent_global") in matrix() and ("throwaway", "l2") not in matrix()
    with pytest.raises(ValueError, match="keeps the same tokens for all heads"):
        check_compatibility(default_cache_kwargs(cache_strategy=["throwaway"], prompt_compression_strategy=["l2"]))
    with pytest.raises(ValueError, match="--throwaway_weight 0"):
        check_compatibility(default_cache_kwargs(cache_strategy=["throwaway"], throwaway_weight=0))
    check_strategy_with_compressor(tiny, "throwaway", "recent_global")
    assert tiny_generate(tiny, lossless_kwargs("debug_throwaway"))[0] == full_tokens


class SpacedCompressor(PromptCompressor):
    """Registered only inside a test: keeps every `spaced_stride`-th position first."""

    params = (Param("spaced_stride", int, 2, "keep positions divisible by this first", minimum=1),)

    def score(self, key_pos, k, v, query, query_pos):
        return (key_pos % self.spaced_stride == 0).float()


class Spaced(KVCache):
    name = "spaced"
    prompt_compressor_class = SpacedCompressor


def kept_positions(model, cache_kwargs: dict) -> list[list[int]]:
    """The positions each layer's cache holds after prefilling a 40-token prompt into 16 slots."""
    _, caches, _ = generation.prefill_prompt(model, tiny_prompt(40, seed=3), 2, cache_kwargs, generation.STEPS)
    return [sorted(p for p in cache.pos[0, 0].tolist() if p >= 0) for cache in caches]


def test_a_compressor_parameter_registered_at_run_time_is_a_flag_and_changes_what_is_kept(monkeypatch, tiny):
    monkeypatch.setitem(strategies.STRATEGIES, "spaced", Spaced)
    help_text = " ".join(generate.build_parser().format_help().split())
    assert "--spaced_stride" in help_text and "spaced: keep positions divisible by this first" in help_text
    kwargs = {"cache_strategy": ["spaced"], "prompt_compression_strategy": ["spaced"], "max_cache_length": [16]}
    kwargs.update(global_tokens=1, recent_window=2)
    by_two = kept_positions(tiny, default_cache_kwargs(**kwargs, spaced_stride=2))
    by_five = kept_positions(tiny, default_cache_kwargs(**kwargs, spaced_stride=5))
    # the global token and the 2 most recent, then multiples of the stride: 13 of the 18 even
    # positions; all 7 multiples of 5 and 6 others
    for kept in by_two:
        assert kept[0] == 0 and kept[-2:] == [38, 39] and all(p % 2 == 0 for p in kept[1:-2])
    for kept in by_five:
        assert {0, 5, 10, 15, 20, 25, 30, 35, 38, 39} <= set(kept) and any(p % 2 for p in kept[1:-2])
    assert relevant_kwargs(default_cache_kwargs(**kwargs, spaced_stride=5))["spaced_stride"] == 5
    with pytest.raises(ValueError, match="--spaced_stride 0 is too small"):
        check_compatibility(default_cache_kwargs(**kwargs, spaced_stride=0))


def test_snapkv_window_is_its_own_parameter(tiny):
    kwargs = {"cache_strategy": ["l2"], "prompt_compression_strategy": ["snapkv"], "max_cache_length": [16]}
    kwargs.update(global_tokens=1, recent_window=2)
    default = kept_positions(tiny, default_cache_kwargs(**kwargs))
    assert kept_positions(tiny, default_cache_kwargs(**kwargs, snapkv_window=2)) == default  # the recent window
    assert kept_positions(tiny, default_cache_kwargs(**kwargs, snapkv_window=30)) != default
    assert relevant_kwargs(default_cache_kwargs(**kwargs, snapkv_window=30))["snapkv_window"] == 30
    with pytest.raises(ValueError, match="--snapkv_pooling 4 is even"):
        check_compatibility(default_cache_kwargs(**kwargs, snapkv_pooling=4))


def test_registry_answers_the_sweep_scripts():
    def ask(*words):
        done = subprocess.run(
            [sys.executable, "-m", "strategies", *words], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        return done.returncode, done.stdout.split(), done.stderr

    assert ask("compressing")[1] == strategies.compressing_strategies()
    assert ask("baseline")[1] == [strategies.DEFAULT_STRATEGY]
    names = strategies.compressing_strategies()
    assert ask("compressor", *names)[1] == [strategies.natural_compressor(n) for n in names]
    assert "l2" in ask("compressor", "l2")[1] and "recent_global" in ask("compressor", "random")[1]
    code, _, err = ask("compressor", "no_such_strategy")
    assert code == 2 and "unknown cache strategy 'no_such_strategy'" in err
