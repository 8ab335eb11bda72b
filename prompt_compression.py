"""Prompt compressors: which prompt tokens enter a cache that is smaller than the prompt.

The prompt itself is prefilled with full attention; a compressor only picks the `budget` positions
(global tokens and the most recent ones always among them) that the cache keeps, in position order.
Prefilled in chunks, the candidates are what the cache holds plus the chunk, ranked together.
Like caches, each compressor is a `score()` of the same signature: higher is kept. A strategy's own
compressor lives in its module in `strategies/`, registered under the strategy's name (and its own
`name`, where it has one); it may declare hyper-parameters of its own, which become flags and preset
keys like a cache's.
"""

import math

import torch
from torch import Tensor

from cache import Param

HEAD_FLOOR = 0.2  # adaptive head budgets: the share of the uniform budget every head keeps (AdaKV's safeguard)


class PromptCompressor:
    """The base score is the position: global tokens plus the most recent."""

    name = ""  # registered under this name too, besides its strategy's
    head_specific = False  # keeps different tokens per KV head: only for head-specific caches
    compresses = True  # False: the cache must hold the whole prompt
    params: tuple[Param, ...] = ()  # its own hyper-parameters

    def __init__(self, global_tokens: int = 1, recent_window: int = 10, **params):
        self.global_tokens = global_tokens
        self.recent_window = recent_window
        for p in self.params:
            setattr(self, p.name, params.get(p.name, p.default))

    def score(self, key_pos: Tensor, k: Tensor, v: Tensor, query: Tensor, query_pos: Tensor) -> Tensor:
        """Importance [B or 1, H or 1, S] of each candidate key k [B, H, S, D] at positions key_pos
        [B or 1, H or 1, S] (-1: an empty slot). The queries [B, H_q, T, D] at query_pos [T] are those
        of the last T candidates: the prompt, or the chunk being prefilled."""
        return key_pos.float()

    def __call__(self, key_pos: Tensor, k: Tensor, v: Tensor, query: Tensor, budget: int, capacity=None) -> Tensor:
        """Indices [B or 1, H or 1, budget] of the candidates to keep, in position order, empty slots
        last; with a `capacity`, [B, H, capacity] under adaptive head budgets (see keep_top)."""
        query_pos = None if query is None else key_pos.reshape(-1, key_pos.shape[-1])[0, -query.shape[2] :]
        return self.keep_top(key_pos, self.score(key_pos, k, v, query, query_pos), budget, capacity)

    def keep_top(self, key_pos: Tensor, score: Tensor, budget: int, capacity: int | None = None) -> Tensor:
        """The global tokens, the most recent and then the highest scores, as `__call__` returns them.

        With a `capacity` (adaptive head budgets, AdaKV) the heads of a layer share budget x heads
        slots: every head keeps its best `floor` candidates, the rest go to the highest scores of any
        head, at most `capacity` per head; a head's unused indices are -1, after its kept ones.
        """
        last = key_pos.amax(dim=-1, keepdim=True)
        protected = (key_pos < self.global_tokens) | (key_pos > last - self.recent_window)
        score = torch.where(protected, math.inf, score.float())
        score = torch.where(key_pos < 0, -math.inf, score)
        keep = score.topk(budget, dim=-1).indices if capacity is None else self.share(score, budget, capacity)
        kept_pos = key_pos.expand_as(score).gather(-1, keep.clamp(min=0))
        last_ones = (kept_pos < 0) | (keep < 0)
        order = torch.where(last_ones, torch.iinfo(kept_pos.dtype).max, kept_pos).argsort(dim=-1)
        return keep.gather(-1, order)

    def share(self, score: Tensor, budget: int, capacity: int) -> Tensor:
        """Indices [B, H, capacity] of a layer's budget x heads best candidates (scores [B, H, S]),
        at least `floor` and at most `capacity` per head; -1 pads a head's share."""
        n_heads, n = score.shape[1], min(capacity, score.shape[-1])
        floor = min(budget, max(math.ceil(HEAD_FLOOR * budget), self.global_tokens + self.recent_window + 1))
        best = score.topk(n, dim=-1)
        rank = torch.arange(n, device=score.device)
        ranked = torch.where(rank < floor, math.inf, best.values)
        ranked = torch.where(ranked == -math.inf, -1e30 * (1.0 + rank), ranked)  # spare slots go round the heads
        chosen = ranked.flatten(1).topk(budget * n_heads, dim=-1).indices
        taken = torch.zeros_like(ranked, dtype=torch.bool).flatten(1).scatter_(1, chosen, True).view_as(ranked)
        keep = torch.where(taken, best.indices, -1)
        return torch.cat([keep, keep.new_full((*keep.shape[:2], capacity - n), -1)], dim=-1)
