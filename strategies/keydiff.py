"""keydiff (KeyDiff, Park et al. 2025): keeps the keys least like the others, per head.

A key's score is its negative cosine similarity to the mean of its head's normalised keys: keys
that stand apart from the rest are kept. No attention probabilities are needed, so attention runs
through the fused kernel.
"""

import torch.nn.functional as F
from torch import Tensor

from cache import KVCache
from prompt_compression import PromptCompressor
from quantization_utils import dense


def key_difference(key_pos: Tensor, k: Tensor) -> Tensor:
    """-cos(key, mean normalised key of its head) [B, H, S] over the keys at key_pos >= 0."""
    normalised = F.normalize(k.float(), dim=-1)
    held = (key_pos >= 0).view(*[1] * (3 - key_pos.dim()), *key_pos.shape, 1).float()
    anchor = (normalised * held).sum(dim=2, keepdim=True) / held.sum(dim=2, keepdim=True).clamp(min=1)
    return -(normalised * F.normalize(anchor, dim=-1)).sum(dim=-1)


class KeyDiffCompressor(PromptCompressor):
    """The keys least like their head's mean key."""

    head_specific = True

    def score(self, key_pos, k, v, query, query_pos):
        return key_difference(key_pos, dense(k))


class KeyDiffCache(KVCache):
    """Scores what the cache holds afresh each step: the mean key moves as tokens come and go."""

    name = "keydiff"
    head_specific = True
    natural_compressor = "keydiff"
    prompt_compressor_class = KeyDiffCompressor

    score = KeyDiffCompressor.score
