"""keep_it_odd: a toy to copy when adding a strategy. Even positions are evicted before odd ones.

A strategy is this file, one line in `strategies/__init__.py` and a preset in `cache_configs/`. Its
prompt compressor (which prompt tokens enter a cache shorter than the prompt) and its cache (which
slot a decode step overwrites) score with one signature; here with one function.
"""

from cache import KVCache
from prompt_compression import PromptCompressor


def odd_first(key_pos, k, v, query, query_pos):
    """Odd positions score 1, even ones 0: the lowest score goes first."""
    return (key_pos % 2).float()


class KeepItOddCompressor(PromptCompressor):
    """At prefill, when the prompt is longer than the cache: odd positions are kept first."""

    score = staticmethod(odd_first)


class KeepItOddCache(KVCache):
    """During decode, when the cache is full: the lowest score (an even position) is overwritten."""

    name = "keep_it_odd"
    prompt_compressor_class = KeepItOddCompressor
    score = staticmethod(odd_first)
