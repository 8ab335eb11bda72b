"""Prompt compressors: which prompt tokens enter a cache that is smaller than the prompt.

The prompt itself is prefilled with full attention; a compressor only picks the `budget` positions
(global tokens and the most recent ones always among them) that the cache keeps, in position order.
Prefilled in chunks, the candidates are what the cache holds plus the chunk, ranked together.
Like caches, each compressor is a `score()`: higher is kept. A strategy's own compressor lives in
its module in `strategies/`, registered under the strategy's name.
"""

import math

import torch
from torch import Tensor


class PromptCompressor:
    """The base score is the position: global tokens plus the most recent."""

    head_specific = False  # keeps different tokens per KV head: only for head-specific caches
    compresses = True  # False: the cache must hold the whole prompt

    def __init__(self, global_tokens: int = 1, recent_window: int = 10):
        self.global_tokens = global_tokens
        self.recent_window = recent_window

    def score(self, key_pos: Tensor, k: Tensor, v: Tensor, query: Tensor) -> Tensor:
        """Importance [B or 1, H or 1, S] of each candidate key k [B, H, S, D] at positions key_pos
        [B or 1, H or 1, S] (-1: an empty slot). The queries [B, H_q, T, D] are those of the last T
        candidates: the prompt, or the chunk being prefilled."""
        return key_pos.float()

    def __call__(self, key_pos: Tensor, k: Tensor, v: Tensor, query: Tensor, budget: int) -> Tensor:
        """Indices [B or 1, H or 1, budget] of the candidates to keep, in position order, empty slots last."""
        return self.keep_top(key_pos, self.score(key_pos, k, v, query), budget)

    def keep_top(self, key_pos: Tensor, score: Tensor, budget: int) -> Tensor:
        """The global tokens, the most recent and then the highest scores, as `__call__` returns them."""
        last = key_pos.amax(dim=-1, keepdim=True)
        protected = (key_pos < self.global_tokens) | (key_pos > last - self.recent_window)
        score = torch.where(protected, math.inf, score.float())
        score = torch.where(key_pos < 0, -math.inf, score)
        keep = score.topk(budget, dim=-1).indices
        kept_pos = key_pos.expand_as(score).gather(-1, keep)
        order = torch.where(kept_pos < 0, torch.iinfo(kept_pos.dtype).max, kept_pos).argsort(dim=-1)
        return keep.gather(-1, order)
