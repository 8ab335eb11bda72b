"""heavy_hitter (H2O / Scissorhands): keeps the tokens that received the most attention, per head.

Its prompt compressor is SnapKV (also registered as `snapkv`). At prefill every kept key's score is
the attention it received from the whole prompt (attention.prompt_attention).
"""

import torch
from torch import Tensor

from attention import pooled, prompt_attention, window_attention
from cache import KVCache, Param
from prompt_compression import PromptCompressor


def check_odd(width: int) -> None:
    if width % 2 == 0:
        raise ValueError(f"--snapkv_pooling {width} is even; give an odd width, so the pooling is centred")


class SnapKVCompressor(PromptCompressor):
    """SnapKV: the tokens that the queries of an observation window (the last ones) attend to most,
    per head, smoothed by pooling over neighbours."""

    name = "snapkv"
    head_specific = True
    params = (
        Param(
            "snapkv_window",
            int,
            None,
            "queries of SnapKV's observation window (none = the recent window)",
            minimum=1,
        ),
        Param("snapkv_pooling", int, 7, "width of SnapKV's average pooling of the scores", minimum=1, check=check_odd),
    )

    def score(self, key_pos, k, v, query, query_pos):
        window = self.recent_window if self.snapkv_window is None else self.snapkv_window
        attn = window_attention(key_pos, k, query, window).flatten(2, 3).mean(dim=2)
        return pooled(attn, self.snapkv_pooling)


class HeavyHitterCache(KVCache):
    """History is a ring of `history_window_size` steps per slot (one accumulating step when the
    window is 1); the score is the mean over the steps recorded since the slot was filled.
    """

    name = "heavy_hitter"
    row_state = {**KVCache.row_state, "step": 0, "own_slots": 0}
    head_specific = True
    needs_attention = True
    natural_compressor = "heavy_hitter"
    prompt_compressor_class = SnapKVCompressor
    params = (
        Param("history_window_size", int, 1, "steps of attention history per slot (1 = the whole history)", minimum=1),
        Param("attn_thresholding", bool, False, "record only whether attention was at least uniform"),
        Param("attn_top_k", float, 1.0, "record only the top fraction of each step's attention", above=0, maximum=1),
    )

    def __init__(self, *args, history_window_size=1, attn_thresholding=False, attn_top_k=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.history_window_size = history_window_size
        self.attn_thresholding = attn_thresholding
        self.attn_top_k = attn_top_k
        self.register_buffer("attn_history", torch.zeros(*self.pos.shape, history_window_size))
        self.register_buffer("attn_counter", torch.zeros(self.pos.shape))
        self.register_buffer("step", torch.zeros(self.pos.shape[0], dtype=torch.long))
        # Each sequence's own cache length: in a batch a row's slots past it are padding.
        self.register_buffer("own_slots", torch.full((self.pos.shape[0],), self.pos.shape[2]), persistent=False)

    def score(self, key_pos, k, v, query, query_pos):
        return self.attn_history.sum(-1) / self.attn_counter.clamp(min=1)

    def prefill_state(self, input_pos, k, v, query, keep):
        return {"attn": prompt_attention(query, k, v, self.attn_thresholding, keep)[1]}

    def attend_prompt(self, input_pos, query, k, v, token_ids=None):
        """The attention statistics come from the pass that computes the output."""
        keep = self.kept_prompt_tokens(input_pos, k, v, query)
        chosen = None if keep is None else keep.clamp(min=0)
        out, received = prompt_attention(query, k, v, self.attn_thresholding, chosen)
        self.insert_prompt(input_pos, k, v, keep, {"attn": received})
        return out

    def insert_state(self, slots, k, state):
        rows = self.flat_rows(slots)
        if "attn" not in state:  # decode: the new token's history starts with this step's attention
            self.write_rows(self.attn_history, rows, 0.0)
            self.write_rows(self.attn_counter, rows, 0.0)
            return
        history = torch.zeros(*slots.shape, self.history_window_size, device=slots.device)
        history[..., 0] = state["attn"]
        self.write_rows(self.attn_history, rows, history)
        self.write_rows(self.attn_counter, rows, 1.0)
        self.step.fill_(1 if slots.shape[-1] else 0)

    def update_state(self, input_pos, k, v, is_prefill, attn):
        attn = attn.mean(dim=2).float()  # average the query heads sharing a KV head; 0 on empty slots
        if is_prefill:  # a prompt chunk is one step: each slot's mean over the chunk's queries that saw it
            seen = ((self.pos.unsqueeze(-2) <= input_pos.view(-1, 1)) & (self.pos.unsqueeze(-2) >= 0)).sum(-2)
            attn, filled = attn.sum(2) / seen.clamp(min=1), seen > 0
        else:
            attn, filled = attn[:, :, -1], self.pos >= 0
        if self.attn_thresholding:
            attn = (attn >= 1.0 / filled.sum(-1, keepdim=True)).float()
        elif self.attn_top_k < 1.0:
            slots = torch.full_like(self.own_slots, attn.shape[-1]) if is_prefill else self.own_slots  # may widen
            attn = keep_top_fraction(attn, self.attn_top_k, filled, slots)
        if self.history_window_size == 1:
            self.attn_history.add_(attn.unsqueeze(-1))
            self.attn_counter += filled
        else:
            ring_slot = (self.step % self.history_window_size).view(-1, 1, 1, 1).expand(*attn.shape, 1)
            self.attn_history.scatter_(3, ring_slot, attn.unsqueeze(-1))
            self.attn_counter.copy_(torch.clamp(self.attn_counter + filled, max=self.history_window_size))
        self.step.add_(1)

    def reset_state(self):
        self.attn_history.zero_()
        self.attn_counter.zero_()
        self.step.zero_()


def keep_top_fraction(attn: Tensor, fraction: float, filled: Tensor, slots: Tensor) -> Tensor:
    """Zeroes all but each head's top ceil(`fraction` x its sequence's `slots` [B]) attention weights
    over filled slots (ties kept). The product is taken in float64, as Python's ceil would take it."""
    k = torch.ceil(slots.double() * fraction).clamp(min=1).long().view(-1, 1, 1).expand(*attn.shape[:-1], 1)
    ranked = attn.masked_fill(filled == 0, -1.0).sort(dim=-1, descending=True).values
    threshold = ranked.gather(-1, k - 1)
    return torch.where(attn >= threshold, attn, torch.zeros_like(attn))
