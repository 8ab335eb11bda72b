"""keep_it_odd: a toy to copy when adding a strategy. Even positions are evicted before odd ones.

A strategy is this file, one line in `strategies/__init__.py` and a preset in `cache_configs/`.
"""

from cache import KVCache
from prompt_compression import PromptCompressor


class KeepItOddCompressor(PromptCompressor):
    """At prefill, when the prompt is longer than the cache: odd positions first."""

    def score(self, key_pos, k, v, query):
        return (key_pos % 2).float()


class KeepItOddCache(KVCache):
    """During decode, when the cache is full: the lowest score (an even position) is overwritten."""

    name = "keep_it_odd"
    prompt_compressor_class = KeepItOddCompressor

    def score(self, input_pos):
        return (self.pos % 2).float()
