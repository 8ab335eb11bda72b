"""Prompt compressors: which prompt tokens enter a cache that is smaller than the prompt.

The prompt itself is prefilled with full attention; a compressor only picks the `budget` positions
(global tokens and the most recent ones always among them) that the cache keeps, in position order.
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

    def score(self, input_pos: Tensor, k: Tensor, v: Tensor, query: Tensor) -> Tensor:
        """Importance [B, H or 1, T] of each prompt token."""
        return input_pos.float().view(1, 1, -1)

    def __call__(self, input_pos: Tensor, k: Tensor, v: Tensor, query: Tensor, budget: int) -> Tensor:
        """Indices [B, H or 1, budget] of the prompt tokens to keep, sorted by position."""
        seqlen = k.shape[2]
        positions = torch.arange(seqlen, device=k.device)
        protected = (positions < self.global_tokens) | (positions >= seqlen - self.recent_window)
        score = self.score(input_pos, k, v, query).float()
        score = torch.where(protected, math.inf, score)
        return score.topk(budget, dim=-1).indices.sort(dim=-1).values
