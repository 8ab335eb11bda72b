"""l2 (Knorm): keeps the keys with the lowest L2 norm, per head; low-norm keys draw the most attention."""

import torch

from cache import KVCache
from prompt_compression import PromptCompressor


class L2Compressor(PromptCompressor):
    """Lowest key norms, per head: a key's norm relative to its head's mean, so that heads sharing a
    budget (adaptive head budgets) compare on one scale; within a head the order is the norm's."""

    head_specific = True

    def score(self, key_pos, k, v, query, query_pos):
        norm = k.float().norm(dim=-1)
        candidate = (key_pos >= 0).expand_as(norm)
        mean = (norm * candidate).sum(-1, keepdim=True) / candidate.sum(-1, keepdim=True).clamp(min=1)
        return -norm / mean.clamp(min=torch.finfo(norm.dtype).tiny)


class L2Cache(KVCache):
    name = "l2"
    head_specific = True
    natural_compressor = "l2"
    prompt_compressor_class = L2Compressor

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("key_norm", torch.zeros(self.pos.shape, dtype=torch.float32))

    def score(self, key_pos, k, v, query, query_pos):
        return -self.key_norm

    def insert_state(self, slots, k, state):
        self.write_slots(self.key_norm, slots, k.float().norm(dim=-1))

    def reset_state(self):
        self.key_norm.zero_()
