"""Prompt compressors: which prompt tokens enter a cache that is smaller than the prompt.

The prompt itself is prefilled with full attention; a compressor only picks the `budget` positions
(global tokens and the most recent ones always among them) that the cache keeps, in position order.
Like caches, each compressor is a `score()`: higher is kept.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# SnapKV smooths the observation window's attention with a 1-D pooling of this width.
SNAPKV_POOLING_KERNEL = 7


class PromptCompressor:
    head_specific = False

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


class FullCompressor(PromptCompressor):
    """No compression: only valid when the cache holds the whole prompt."""

    def __call__(self, input_pos, k, v, query, budget):
        raise ValueError(
            f"prompt of {k.shape[2]} tokens does not fit a {budget}-slot cache with prompt compression 'full'; "
            "choose another --prompt_compression_strategy"
        )


class RecentGlobalCompressor(PromptCompressor):
    """Global tokens plus the most recent: the default score (position) already says so."""


class RandomCompressor(PromptCompressor):
    def score(self, input_pos, k, v, query):
        return torch.rand(1, 1, k.shape[2], device=k.device)


class KeepItOddCompressor(PromptCompressor):
    def score(self, input_pos, k, v, query):
        return (input_pos % 2).float().view(1, 1, -1)


class L2Compressor(PromptCompressor):
    """Lowest key norms, per head."""

    head_specific = True

    def score(self, input_pos, k, v, query):
        return -k.float().norm(dim=-1)


class SnapKVCompressor(PromptCompressor):
    """SnapKV: tokens the last `recent_window` queries (the observation window) attend to most, per head."""

    head_specific = True

    def score(self, input_pos, k, v, query):
        bsz, n_head, seqlen, head_dim = query.shape
        n_kv = k.shape[1]
        window = max(1, min(self.recent_window, seqlen))
        q = query[:, :, -window:].float().reshape(bsz, n_kv, n_head // n_kv * window, head_dim)
        scores = q @ k.float().transpose(-1, -2) / math.sqrt(head_dim)
        rows = torch.arange(seqlen - window, seqlen, device=k.device).repeat(n_head // n_kv)
        causal = torch.arange(seqlen, device=k.device).view(1, -1) <= rows.view(-1, 1)
        attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).mean(dim=2)
        return F.avg_pool1d(attn, SNAPKV_POOLING_KERNEL, stride=1, padding=SNAPKV_POOLING_KERNEL // 2)


PROMPT_COMPRESSORS: dict[str, type[PromptCompressor]] = {
    "full": FullCompressor,
    "recent_global": RecentGlobalCompressor,
    "random": RandomCompressor,
    "l2": L2Compressor,
    "heavy_hitter": SnapKVCompressor,
    "keep_it_odd": KeepItOddCompressor,
}


def get_prompt_compressor(name: str) -> type[PromptCompressor]:
    if name not in PROMPT_COMPRESSORS:
        raise ValueError(f"unknown prompt compression strategy '{name}'; choose from: {', '.join(PROMPT_COMPRESSORS)}")
    return PROMPT_COMPRESSORS[name]


def prompt_compressor_is_head_specific(name: str) -> bool:
    return get_prompt_compressor(name).head_specific
