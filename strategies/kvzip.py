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

from attention import attention_and_lse, score_dtype
from cache import KVCache

REPEAT_REQUEST = "\n\nRepeat the previous context exactly.\n"
SCORE_BLOCK = 128  # query rows per score product: 3 KV heads x 4K context is 6 MiB of float32 scores


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

    def score(self, key_pos, k, v, query, query_pos):
        return self.max_received

    def attend_prompt(self, input_pos, query, k, v, token_ids=None):
        """A context over the budget is held whole, in widened buffers, until it is scored."""
        if k.shape[2] <= self.budget - self.reserved_slots:
            return super().attend_prompt(input_pos, query, k, v, token_ids)
        self.awaiting = self.widen(k.shape[2])
        slots = torch.arange(k.shape[2], device=k.device).expand(*k.shape[:2], -1)
        self.write(slots, input_pos.expand_as(slots), k, v)
        self.insert_state(slots, k, {})
        return F.scaled_dot_product_attention(query, k, v, is_causal=True, enable_gqa=True)

    @torch.compiler.disable  # swaps in wider buffers
    def attend_chunk(self, input_pos, query, k, v, token_ids=None):
        """More context that does not fit: held whole too, until the reconstruction pass."""
        if self.peeking:
            return self.peek(query, k, v)
        held = int((self.pos >= 0).sum(-1).max())
        if self.awaiting is None and held + k.shape[2] <= self.budget - self.reserved_slots:
            return super().attend_chunk(input_pos, query, k, v, token_ids)
        originals, out, _, _ = self.join_chunk(input_pos, query, k, v)
        self.awaiting = self.awaiting or originals
        return out

    def peek(self, query, k, v):
        """A reconstruction chunk, k/v [B, H, N, D] after every held token: attended and dropped.

        The context (the held slots, the same in every head while it awaits its scores) and the
        chunk (causally) are attended apart and merged by their log-sum-exp, with no mask; each
        context key's largest probability is exp(max over queries of score - lse), from a matmul (in
        the cache's dtype, or float32 where half precision is emulated) whose queries carry -lse as
        extra dimensions, taken a block of queries at a time so that the scores stay in the CPU's
        cache instead of filling memory (queries x context)."""
        bsz, n_kv, n, head_dim = k.shape
        group = query.shape[1] // n_kv
        held = (self.pos[0, 0] >= 0).nonzero().squeeze(1)
        keys, values = self.dense()
        context_k, context_v = keys[:, :, held], values[:, :, held]
        q = query.reshape(bsz, n_kv, group * n, head_dim)
        out_context, lse_context = attention_and_lse(q, context_k, context_v)
        out_chunk, lse_chunk = attention_and_lse(
            query, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), causal=True
        )
        lse_chunk = lse_chunk.reshape(lse_context.shape)
        lse = torch.logaddexp(lse_context, lse_chunk)
        out = out_context.float() * (lse_context - lse).exp().unsqueeze(-1)
        out += out_chunk.float().reshape(out.shape) * (lse_chunk - lse).exp().unsqueeze(-1)
        work = score_dtype(q)
        neg_lse = -lse.unsqueeze(-1)
        high = neg_lse.to(work)  # in two parts, so that half precision keeps the log-sum-exp's
        scaled = q.to(work) * (1.0 / math.sqrt(head_dim))
        queries = torch.cat([scaled, high, (neg_lse - high.float()).to(work)], dim=-1)
        ones = context_k.new_ones((*context_k.shape[:3], 2), dtype=work)
        keys_t = torch.cat([context_k.to(work), ones], dim=-1).transpose(-1, -2)
        largest = torch.full((bsz, n_kv, keys_t.shape[-1]), -math.inf, dtype=work, device=k.device)
        for start in range(0, queries.shape[2], SCORE_BLOCK):  # score - lse, a block of queries at a time
            torch.maximum(largest, (queries[:, :, start : start + SCORE_BLOCK] @ keys_t).amax(dim=2), out=largest)
        self.max_received[:, :, held] = torch.maximum(self.max_received[:, :, held], largest.float().exp())
        return out.to(query.dtype).view(query.shape)

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
        budgets = self.budgets(self.awaiting["pos"].shape[2])
        keep = self.prompt_compressor.keep_top(self.pos, self.max_received, **budgets)
        self.narrow(self.awaiting, keep)
        self.awaiting = None

    def reset_state(self):
        self.max_received.zero_()
        if self.awaiting is not None:  # a prefill stopped before its reconstruction pass
            self.narrow(self.awaiting, self.pos.new_zeros(*self.pos.shape[:2], 0, dtype=torch.long))
            self.awaiting = None
