"""recent_global (StreamingLLM): attention sinks plus a sliding window of the most recent tokens."""

from cache import KVCache
from prompt_compression import PromptCompressor


class RecentGlobalCompressor(PromptCompressor):
    """Global tokens plus the most recent: the default score (position) already says so."""


class RecentGlobalCache(KVCache):
    """The oldest non-global token goes first: the base score (position) is the whole strategy."""

    name = "recent_global"
    prompt_compressor_class = RecentGlobalCompressor
    shared_kwargs = ("max_cache_length", "global_tokens", "cache_bits")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "recent_window": 0})
