"""heavy_hitter (H2O / Scissorhands): keeps the tokens that received the most attention, per head.

Its prompt compressor is SnapKV. The prompt-attention numerics below serve this strategy alone: at
prefill every kept key's score is the attention it received from the whole prompt, computed without
materializing heads x T x T.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from cache import KVCache, Param
from one_token import matmul_dtype
from prompt_compression import PromptCompressor

# SnapKV smooths the observation window's attention with a 1-D pooling of this width.
SNAPKV_POOLING_KERNEL = 7
# Query rows per chunk when prefill needs attention probabilities: bounds memory at
# PREFILL_CHUNK_ELEMENTS floats instead of heads x seq x seq.
PREFILL_CHUNK_ELEMENTS = 1 << 22


class SnapKVCompressor(PromptCompressor):
    """SnapKV: tokens the last `recent_window` queries (the observation window) attend to most, per head."""

    head_specific = True

    def score(self, key_pos, k, v, query):
        bsz, n_head, _, head_dim = query.shape
        n_kv = k.shape[1]
        window = max(1, min(self.recent_window, query.shape[2]))
        q = query[:, :, -window:].float().reshape(bsz, n_kv, n_head // n_kv * window, head_dim)
        scores = q @ k.float().transpose(-1, -2) / math.sqrt(head_dim)
        query_pos = key_pos[..., -window:].unsqueeze(-1)  # the queries are the last candidates
        visible = ((key_pos.unsqueeze(-2) <= query_pos) & (key_pos.unsqueeze(-2) >= 0)).repeat(1, 1, n_head // n_kv, 1)
        attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).mean(dim=2)
        return F.avg_pool1d(attn, SNAPKV_POOLING_KERNEL, stride=1, padding=SNAPKV_POOLING_KERNEL // 2)


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

    def score(self, input_pos):
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


def cpu_flash_attention(
    query: Tensor, k: Tensor, v: Tensor, scale: float | None = None, causal: bool = True
) -> tuple[Tensor, Tensor]:
    """Attention (heads already repeated for GQA) and each query's log-sum-exp [B, H, T]: the kernel
    behind SDPA on CPU, bit-identical to it, which also returns the log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, causal, scale=scale)[:2]


def prompt_attention(
    query: Tensor, k: Tensor, v: Tensor, thresholding: bool = False, keep: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Causal attention over the prompt: (output [B, H, T, D], mean attention that each kept key
    (indices `keep` [B, H_kv, n]; None: every key) received from the queries that see it [B, H_kv, n]).

    Never materializes heads x T x T. On CPU the fused kernel returns each query's log-sum-exp, so
    a probability is exp(score - lse): for kept keys that is one pass over the n kept keys. For all
    keys, the attention key j receives, sum over i >= j of exp(q_i.k_j / sqrt(d) - lse_i), is itself
    a log-sum-exp: that of a second fused causal pass with keys and queries swapped, the sequence
    reversed, and -lse_i appended to query i against a 1 appended to each key (split in two parts
    so bfloat16 keeps its precision). Thresholding counts probabilities one by one, so it (and
    devices without that kernel) takes the chunked softmax pass.
    """
    if query.device.type != "cpu" or thresholding:
        out, received = chunked_prompt_attention(query, k, v, thresholding)
        return out, (received if keep is None else received.gather(2, keep))
    bsz, n_head, seqlen, head_dim = query.shape
    group = n_head // k.shape[1]
    k_rep = k.repeat_interleave(group, dim=1)
    out, lse = cpu_flash_attention(query, k_rep, v.repeat_interleave(group, dim=1))
    if keep is not None:
        return out, attention_received_by(
            query, k.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, head_dim)), keep, lse
        )
    lse = lse.unsqueeze(-1) * -math.sqrt(head_dim)  # the kernel scales every score by 1/sqrt(head_dim)
    lse_hi = lse.to(query.dtype)
    lse_lo = (lse - lse_hi.float()).to(query.dtype)
    ones = torch.ones_like(lse_hi)
    keys_as_queries = torch.cat([k_rep, ones, ones], dim=-1).flip(2)
    queries_as_keys = torch.cat([query, lse_hi, lse_lo], dim=-1).flip(2)
    scale = 1.0 / math.sqrt(head_dim)
    received_lse = cpu_flash_attention(keys_as_queries, queries_as_keys, torch.zeros_like(queries_as_keys), scale)[1]
    received = received_lse.flip(2).exp().view(bsz, -1, group, seqlen).sum(2)
    return out, received / (group * torch.arange(seqlen, 0, -1, device=k.device).float())


@torch.compiler.disable  # a Python loop over the prompt's chunks: compiling it would unroll every chunk
def attention_received_by(query: Tensor, keys: Tensor, key_pos: Tensor, lse: Tensor) -> Tensor:
    """Mean attention [B, H_kv, n] that keys [B, H_kv, n, D] at prompt positions key_pos [B, H_kv, n]
    (ascending, as compressors return them) received, from each query's log-sum-exp lse [B, H, T]
    over the whole prompt: exp(q.k / sqrt(d) - lse), one float32 matmul with -lse appended to q and
    1 to k, summed over the queries that see the key, in query chunks of PREFILL_CHUNK_ELEMENTS.
    A chunk skips the keys that come after all of its queries."""
    bsz, n_head, seqlen, head_dim = query.shape
    n_kv, n_keys = keys.shape[1], keys.shape[2]
    group = n_head // n_kv
    q = (query.float() * (1.0 / math.sqrt(head_dim))).view(bsz, n_kv, group, seqlen, head_dim)
    q = torch.cat([q, -lse.view(bsz, n_kv, group, seqlen, 1)], dim=-1)
    keys_t = torch.cat([keys.float(), keys.new_ones(bsz, n_kv, n_keys, 1, dtype=torch.float)], dim=-1)
    keys_t = keys_t.transpose(-1, -2).unsqueeze(2)
    first_seen = key_pos.view(bsz, n_kv, 1, 1, n_keys)
    received = torch.zeros(bsz, n_kv, n_keys, device=keys.device)
    chunk = max(1, PREFILL_CHUNK_ELEMENTS // (n_head * n_keys))
    for start in range(0, seqlen, chunk):
        end = min(start + chunk, seqlen)
        seen = int((key_pos < end).sum(-1).max())
        probs = (q[:, :, :, start:end] @ keys_t[..., :seen]).exp_()
        query_pos = torch.arange(start, end, device=keys.device).view(-1, 1)
        received[..., :seen] += probs.masked_fill_(query_pos < first_seen[..., :seen], 0.0).sum(dim=(2, 3))
    return received / (group * (seqlen - key_pos).float())


@torch.compiler.disable  # a Python loop over the prompt's chunks: compiling it would unroll every chunk
def chunked_prompt_attention(query: Tensor, k: Tensor, v: Tensor, thresholding: bool) -> tuple[Tensor, Tensor]:
    """prompt_attention as SDPA plus a softmax pass over query chunks: memory stays bounded by
    PREFILL_CHUNK_ELEMENTS, and a query that sees one key gives it exactly 1 (thresholds compare)."""
    bsz, n_head, seqlen, head_dim = query.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    out = F.scaled_dot_product_attention(query, k, v, is_causal=True, enable_gqa=True)
    work = matmul_dtype(k)
    q = (query * (1.0 / math.sqrt(head_dim))).to(work).view(bsz, n_kv, group, seqlen, head_dim)
    keys_t = k.transpose(-1, -2).to(work)
    received = torch.zeros(bsz, n_kv, seqlen, device=k.device)
    chunk = max(1, PREFILL_CHUNK_ELEMENTS // (n_head * seqlen))
    key_pos = torch.arange(seqlen, device=k.device)
    for start in range(0, seqlen, chunk):
        end = min(start + chunk, seqlen)  # a chunk's queries see no key past its last row
        rows = end - start
        q_rows = q[:, :, :, start:end].reshape(bsz, n_kv, group * rows, head_dim)
        scores = (q_rows @ keys_t[..., :end]).view(bsz, n_kv, group, rows, end).float()
        future = key_pos[start:end].view(1, -1) > key_pos[start:end].view(-1, 1)
        scores[..., start:end].masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if thresholding:
            probs = (probs >= 1.0 / (key_pos[start:end] + 1).view(-1, 1).float()).float()
        received[..., :end] += probs.sum(dim=(2, 3))
    received /= group * (seqlen - key_pos).float()
    return out, received
