"""tova (TOVA, Oren et al. 2024): keeps the tokens the current query attends to most.

The score is the attention from the latest query alone, no history, averaged over all of a layer's
heads as in the paper, so that every head keeps the same tokens: each decode step the slot the
previous step's query attended to least is overwritten. As a prompt compressor it ranks the prompt
by the attention of its last query. (Ranked per head instead, on the embedded model the last query
of a context alone keeps no needle at a 25% budget.)
"""

import torch
from torch import Tensor

from attention import window_attention
from cache import KVCache
from prompt_compression import PromptCompressor


def last_query_attention(key_pos: Tensor, k: Tensor, query: Tensor) -> Tensor:
    """Attention [B, 1, S] from the last query to keys k [B, H_kv, S, D] at key_pos (-1: empty),
    averaged over all query heads."""
    return window_attention(key_pos, k, query, 1).mean(dim=(1, 2, 3)).unsqueeze(1)


class TovaCompressor(PromptCompressor):
    """The attention of the last query, averaged over the heads."""

    def score(self, key_pos, k, v, query, query_pos):
        return last_query_attention(key_pos, k, query)


class TovaCache(KVCache):
    name = "tova"
    needs_attention = True
    natural_compressor = "tova"
    prompt_compressor_class = TovaCompressor

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("last_attention", torch.zeros(self.pos.shape, dtype=torch.float32))

    def score(self, key_pos, k, v, query, query_pos):
        return self.last_attention

    def prefill_state(self, input_pos, k, v, query, keep):
        received = last_query_attention(input_pos.view(1, 1, -1), k, query).expand(-1, k.shape[1], -1)
        return {"attn": received if keep is None else received.gather(2, keep)}

    def insert_state(self, slots, k, state):
        self.write_slots(self.last_attention, slots, state.get("attn", 0.0))

    def update_state(self, input_pos, k, v, is_prefill, attn):
        self.last_attention.copy_(attn[:, :, :, -1].float().mean(dim=(1, 2)).unsqueeze(1).expand_as(self.pos))

    def reset_state(self):
        self.last_attention.zero_()
