"""kvzip (KVzip, Kim et al. 2025): keeps the tokens the model needs to reconstruct its context.

When the context does not fit the budget, the cache first holds all of it. Then the model reads a
request to repeat the context followed by the context again, teacher-forced in chunks after it
(generation.reconstruct_context); every cache attends to those tokens without keeping them, and this
one records for each context token the largest attention it receives from them, per KV head (max
over its query heads). The cache then keeps the highest. Query-agnostic by construction; the price
is a second pass over the context, and a prefill that holds the whole context whatever the chunk
size. During decode a token's score keeps growing with the largest attention it receives.
"""

import math

import torch
import torch.nn.functional as F

from cache import KVCache
from one_token import matmul_dtype

REPEAT_REQUEST = "\n\nRepeat the previous context exactly.\n"


class KVzipCache(KVCache):
    name = "kvzip"
    head_specific = True
    needs_attention = True
    reconstructs_context = True

    @classmethod
    def tokenizer_kwargs(cls, tokenizer) -> dict:
        return {"repeat_request_ids": tokenizer.encode(REPEAT_REQUEST, bos=False)}

    def __init__(self, *args, repeat_request_ids=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.repeat_request_ids = list(repeat_request_ids)  # without a tokenizer: the context alone
        self.register_buffer("max_received", torch.zeros(self.pos.shape, dtype=torch.float32))
        self.awaiting = None  # the buffers of the budget's size while the whole context is held

    def score(self, input_pos):
        return self.max_received

    def attend_prompt(self, input_pos, query, k, v, token_ids=None):
        """A context over the budget is held whole, in widened buffers, until it is scored."""
        if k.shape[2] <= self.max_cache_length - self.reserved_slots:
            return super().attend_prompt(input_pos, query, k, v, token_ids)
        self.awaiting = self.widen(k.shape[2])
        slots = torch.arange(k.shape[2], device=k.device).expand(*k.shape[:2], -1)
        self.write(slots, input_pos.expand_as(slots), k, v)
        self.insert_state(slots, k, {})
        return F.scaled_dot_product_attention(query, k, v, is_causal=True, enable_gqa=True)

    @torch.compiler.disable  # swaps in wider buffers
    def attend_chunk(self, input_pos, query, k, v, token_ids=None):
        """More context that does not fit: held whole too, until the reconstruction pass."""
        held = int((self.pos >= 0).sum(-1).max())
        if self.peeking or (self.awaiting is None and held + k.shape[2] <= self.max_cache_length - self.reserved_slots):
            return super().attend_chunk(input_pos, query, k, v, token_ids)
        originals, out, _, _ = self.join_chunk(input_pos, query, k, v)
        self.awaiting = self.awaiting or originals
        return out

    def chunk_attention(self, input_pos, k, v, q, keys, values, mask):
        """While peeking: the fused kernel's output and log-sum-exp give each key's largest
        probability, exp(max over queries of score - lse), with no probability matrix."""
        if not self.peeking or q.device.type != "cpu":
            return super().chunk_attention(input_pos, k, v, q, keys, values, mask)
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, attn_mask=additive)
        work = matmul_dtype(keys)
        scores = (q.to(work) @ keys.to(work).transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
        largest = (scores.masked_fill_(~mask, float("-inf")) - lse.unsqueeze(-1)).amax(dim=2).exp()
        torch.maximum(self.max_received, largest, out=self.max_received)
        return out

    def insert_state(self, slots, k, state):
        self.write_slots(self.max_received, slots, 0.0)

    def update_state(self, input_pos, k, v, is_prefill, attn):
        received = attn.float().amax(dim=(2, 3)) if is_prefill else attn[:, :, :, -1].float().amax(dim=2)
        torch.maximum(self.max_received, received, out=self.max_received)

    def reconstruction_prompt(self):
        return None if self.awaiting is None else self.repeat_request_ids

    def finish_reconstruction(self):
        if self.awaiting is None:
            return
        budget = self.awaiting["pos"].shape[2] - self.reserved_slots
        keep = self.prompt_compressor.keep_top(self.pos, self.max_received, budget)
        self.narrow(self.awaiting, keep)
        self.awaiting = None

    def reset_state(self):
        self.max_received.zero_()
        if self.awaiting is not None:  # a prefill stopped before its reconstruction pass
            self.narrow(self.awaiting, self.pos.new_zeros(*self.pos.shape[:2], 0, dtype=torch.long))
            self.awaiting = None
