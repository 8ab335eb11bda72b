"""full: keeps every token. The baseline every compressing strategy is measured against."""

from cache import KVCache
from prompt_compression import PromptCompressor


class FullCompressor(PromptCompressor):
    """No compression: only valid when the cache holds the whole prompt."""

    compresses = False

    def __call__(self, key_pos, k, v, query, budget, capacity=None):  # never compresses: nothing to share
        held = int((key_pos >= 0).sum(-1).max())
        if held > budget:
            raise ValueError(
                f"prompt of {held} tokens does not fit a {budget}-slot cache with prompt compression 'full'; "
                "choose another --prompt_compression_strategy"
            )
        return super().__call__(key_pos, k, v, query, budget)


class FullCache(KVCache):
    """Its length is the whole sequence, so nothing is ever evicted."""

    name = "full"
    spans_sequence = True
    baseline = True
    prompt_compressor_class = FullCompressor
    shared_kwargs = ("cache_bits",)

    def eviction_slots(self, input_pos, query=None):
        """Slot i holds position i: no scoring needed on the hot path."""
        return input_pos.view(-1, 1, 1).expand(*self.pos.shape[:2], 1)
