"""KV-cache strategies: one small class per strategy whose only job is to score cache slots.

Every cache holds fixed-size buffers of `max_cache_length` slots. The base class owns the shared
mechanics -- filling empty slots first, never evicting global or recent tokens, overwriting the
lowest-scored slot, prompt compression at prefill, quantized storage and statistics -- so that a
strategy is a `score()` method plus whatever state that score needs. Shapes never change after
construction and the decode path has no data-dependent Python control flow, so it compiles.
"""

import argparse
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch import Tensor

from model import attention_with_probs, matmul_dtype
from prompt_compression import get_prompt_compressor, prompt_compressor_is_head_specific
from quantization_utils import SUPPORTED_BITS, QuantizedTensor, packed_dim, quantize

CACHE_CONFIG_DIR = Path(__file__).resolve().parent / "cache_configs"
PATTERNS = ("tile", "repeat", "pyramid", "funnel")
# Query rows per chunk when prefill needs attention probabilities: bounds memory at
# PREFILL_CHUNK_ELEMENTS floats instead of heads x seq x seq.
PREFILL_CHUNK_ELEMENTS = 1 << 22


class KVCache(nn.Module):
    """Base cache: the eviction mechanics. Subclasses override `score` (higher = keep)."""

    relevant_kwargs = ["max_cache_length", "global_tokens", "recent_window", "cache_bits"]
    head_specific = False

    def __init__(
        self,
        max_batch_size: int,
        n_heads: int,
        head_dim: int,
        max_cache_length: int,
        dtype: torch.dtype = torch.bfloat16,
        global_tokens: int = 1,
        recent_window: float = 10,
        cache_bits: int | None = None,
        prompt_compressor=None,
        **kwargs,
    ):
        super().__init__()
        self.max_cache_length = max_cache_length
        self.global_tokens = global_tokens
        self.recent_window = resolve_recent_window(recent_window, max_cache_length, global_tokens)
        self.cache_bits = cache_bits
        self.dtype = dtype
        self.prompt_compressor = prompt_compressor
        shape = (max_batch_size, n_heads, max_cache_length)
        if cache_bits is None:
            self.register_buffer("k_cache", torch.zeros(*shape, head_dim, dtype=dtype))
            self.register_buffer("v_cache", torch.zeros(*shape, head_dim, dtype=dtype))
        else:
            for name in ("k", "v"):
                packed = torch.zeros(*shape, packed_dim(head_dim, cache_bits), dtype=torch.uint8)
                self.register_buffer(f"{name}_packed", packed)
                self.register_buffer(f"{name}_scale", torch.zeros(*shape, 1, dtype=dtype))
                self.register_buffer(f"{name}_zero", torch.zeros(*shape, 1, dtype=dtype))
        self.register_buffer("pos", torch.full(shape, -1, dtype=torch.int))
        # First flat row of each (batch, head) in a [B, H, L, ...] buffer viewed as [B * H * L, ...].
        offsets = torch.arange(max_batch_size * n_heads).view(max_batch_size, n_heads, 1) * max_cache_length
        self.register_buffer("row_offsets", offsets, persistent=False)

    # -- what a strategy may override -------------------------------------------------------
    def score(self, input_pos: Tensor) -> Tensor:
        """Importance of each slot, [B, H or 1, L]; the lowest evictable slot is overwritten."""
        return self.pos.float()

    def return_attn(self) -> bool:
        return False

    def prefill_state(self, input_pos: Tensor, k: Tensor, v: Tensor, query: Tensor, keep: Tensor | None):
        """State [B, H, n] the strategy scores with, for the kept prompt tokens `keep` (None: all),
        from the whole prompt: what a token received from tokens the cache drops still counts."""
        return {}

    def insert_state(self, slots: Tensor, k: Tensor, state: dict[str, Tensor]) -> None:
        """Records the state of newly inserted slots [B, H, n]; `state` is empty during decode."""

    def update_state(self, input_pos: Tensor, k: Tensor, v: Tensor, is_prefill: bool, attn: Tensor) -> None:
        """Records attention [B, H, G, T, L] after a decode step (only called when return_attn())."""

    def reset_state(self) -> None:
        """Clears strategy state between examples."""

    # -- the shared mechanics ---------------------------------------------------------------
    def reset(self) -> None:
        self.pos.fill_(-1)
        self.reset_state()

    def update_kv(self, input_pos: Tensor, k: Tensor, v: Tensor, is_prefill: bool = False, query=None, **kwargs):
        """Inserts k/v [B, H, T, D]; returns the keys, values and slot mask attention must use."""
        if is_prefill:
            self.prefill(input_pos, k, v, query)
        else:
            slots = self.eviction_slots(input_pos)
            self.write(slots, input_pos.view(1, 1, 1).expand_as(slots), k, v)
            self.insert_state(slots, k, {})
        keys, values = self.read()
        return keys, values, self.pos >= 0

    def eviction_slots(self, input_pos: Tensor) -> Tensor:
        """Slot [B, H, 1] for the next token: an empty one if any, else the least important evictable."""
        score = self.score(input_pos).expand_as(self.pos)
        protected = (self.pos < self.global_tokens) | (self.pos >= input_pos - self.recent_window)
        score = torch.where(protected, math.inf, score)
        score = torch.where(self.pos < 0, -math.inf, score)
        return score.argmin(dim=-1, keepdim=True)

    def attend_prompt(self, input_pos: Tensor, query: Tensor, k: Tensor, v: Tensor, token_ids=None) -> Tensor:
        """The prompt's causal attention output [B, H, T, D]; fills the cache on the way."""
        self.update_kv(input_pos, k, v, is_prefill=True, query=query, token_ids=token_ids)
        return F.scaled_dot_product_attention(query, k, v, is_causal=True, enable_gqa=True)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, query: Tensor) -> None:
        """Fills the cache from the prompt: the tokens its compressor keeps, with their state."""
        keep = self.kept_prompt_tokens(input_pos, k, v, query)
        self.insert_prompt(input_pos, k, v, keep, self.prefill_state(input_pos, k, v, query, keep))

    def kept_prompt_tokens(self, input_pos: Tensor, k: Tensor, v: Tensor, query: Tensor) -> Tensor | None:
        """Indices [B, H, n] of the prompt tokens the cache keeps (the prompt compressor's choice when
        the prompt does not fit), None when it keeps them all."""
        if k.shape[2] <= self.max_cache_length:
            return None
        keep = self.prompt_compressor(input_pos, k, v, query, self.max_cache_length)
        return keep.expand(k.shape[0], k.shape[1], -1)

    def insert_prompt(self, input_pos: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, state: dict) -> None:
        """Writes the kept prompt tokens (state already for those tokens) into slots 0..n-1."""
        bsz, n_heads = k.shape[:2]
        if keep is not None:
            gather = keep.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
            input_pos, k, v = input_pos[keep], k.gather(2, gather), v.gather(2, gather)
        slots = torch.arange(k.shape[2], device=k.device).expand(bsz, n_heads, -1)
        self.write(slots, input_pos.expand_as(slots), k, v)
        self.insert_state(slots, k, state)

    def write(self, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Stores k/v [B, H, n, D] into slots [B, H, n], quantizing when the cache is low-bit."""
        rows = self.flat_rows(slots)
        self.write_rows(self.pos, rows, positions)
        if self.cache_bits is None:
            self.write_rows(self.k_cache, rows, k)
            self.write_rows(self.v_cache, rows, v)
            return
        for name, x in (("k", k), ("v", v)):
            packed, scale, zero = quantize(x.to(self.dtype), self.cache_bits)
            self.write_rows(getattr(self, f"{name}_packed"), rows, packed)
            self.write_rows(getattr(self, f"{name}_scale"), rows, scale)
            self.write_rows(getattr(self, f"{name}_zero"), rows, zero)

    def write_slots(self, buffer: Tensor, slots: Tensor, values) -> None:
        """buffer[b, h, slots[b, h, i]] = values[b, h, i] (or a number) for a [B, H, L, ...] buffer."""
        self.write_rows(buffer, self.flat_rows(slots), values)

    def flat_rows(self, slots: Tensor) -> Tensor:
        """Rows of slots [B, H, n] in a [B, H, L, ...] buffer viewed as [B * H * L, ...]."""
        return (self.row_offsets + slots).flatten()

    def write_rows(self, buffer: Tensor, rows: Tensor, values) -> None:
        """write_slots with flat_rows computed once for several buffers.

        One index_copy_ over flattened (batch, head, slot) rows: scatter_ copies the whole buffer on
        CPU for some dtypes, which made each decode step proportional to the cache length.
        """
        flat = buffer.view(-1, *buffer.shape[3:])
        if isinstance(values, Tensor):
            flat.index_copy_(0, rows, values.reshape(-1, *buffer.shape[3:]).to(buffer.dtype))
        else:
            flat.index_fill_(0, rows, values)

    def read(self) -> tuple:
        """Keys and values for attention; a low-bit cache hands over its packed codes (QuantizedTensor),
        which attention_with_probs multiplies without dequantizing the whole cache."""
        if self.cache_bits is None:
            return self.k_cache, self.v_cache
        return tuple(
            QuantizedTensor(
                getattr(self, f"{n}_packed"), getattr(self, f"{n}_scale"), getattr(self, f"{n}_zero"), self.cache_bits
            )
            for n in ("k", "v")
        )

    def compute_statistics(self, seq_len: int) -> dict:
        """SPEC section 7: compression ratio over the n = seq_len tokens that passed through, and bytes."""
        kept = (self.pos >= 0).sum(-1).float().mean().item()
        if self.cache_bits is not None:
            kept *= self.cache_bits / 16
        return {
            "compression_ratio": (seq_len - kept) / seq_len,
            "cache_memory_bytes": state_bytes(self),
        }


def state_bytes(cache: nn.Module) -> int:
    """Bytes of a cache's persistent buffers: its memory, without bookkeeping such as row_offsets."""
    return sum(t.numel() * t.element_size() for t in cache.state_dict().values())


class FullCache(KVCache):
    """Keeps everything; its length is the whole sequence, so nothing is ever evicted."""

    relevant_kwargs = ["cache_bits"]

    def eviction_slots(self, input_pos):
        """Slot i holds position i: no scoring needed on the hot path."""
        return input_pos.view(1, 1, 1).expand(*self.pos.shape[:2], 1)


class RecentGlobalCache(KVCache):
    """StreamingLLM: attention sinks plus a sliding window; the oldest non-global token goes first."""

    relevant_kwargs = ["max_cache_length", "global_tokens", "cache_bits"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "recent_window": 0})


class RandomCache(KVCache):
    """Evicts a uniformly random unprotected token: the baseline any scoring must beat."""

    def score(self, input_pos):
        return torch.rand(self.pos.shape[0], 1, self.pos.shape[2], device=self.pos.device)


class KeepItOddCache(KVCache):
    """Toy example to copy when adding a strategy: even positions are evicted before odd ones."""

    def score(self, input_pos):
        return (self.pos % 2).float()


class L2Cache(KVCache):
    """Keeps the keys with the lowest L2 norm, per head (low-norm keys draw the most attention)."""

    head_specific = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("key_norm", torch.zeros(self.pos.shape, dtype=torch.float32))

    def score(self, input_pos):
        return -self.key_norm

    def insert_state(self, slots, k, state):
        self.write_slots(self.key_norm, slots, k.float().norm(dim=-1))

    def reset_state(self):
        self.key_norm.zero_()


class HeavyHitterCache(KVCache):
    """H2O / Scissorhands: keeps the tokens that received the most attention, per head.

    History is a ring of `history_window_size` steps per slot (one accumulating step when the
    window is 1); the score is the mean over the steps recorded since the slot was filled.
    """

    relevant_kwargs = KVCache.relevant_kwargs + ["history_window_size", "attn_thresholding", "attn_top_k"]
    head_specific = True

    def __init__(self, *args, history_window_size=1, attn_thresholding=False, attn_top_k=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.history_window_size = history_window_size
        self.attn_thresholding = attn_thresholding
        self.attn_top_k = attn_top_k
        self.register_buffer("attn_history", torch.zeros(*self.pos.shape, history_window_size))
        self.register_buffer("attn_counter", torch.zeros(self.pos.shape))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def return_attn(self):
        return True

    def score(self, input_pos):
        return self.attn_history.sum(-1) / self.attn_counter.clamp(min=1)

    def prefill_state(self, input_pos, k, v, query, keep):
        return {"attn": prompt_attention(query, k, v, self.attn_thresholding, keep)[1]}

    def attend_prompt(self, input_pos, query, k, v, token_ids=None):
        """The attention statistics come from the pass that computes the output."""
        keep = self.kept_prompt_tokens(input_pos, k, v, query)
        out, received = prompt_attention(query, k, v, self.attn_thresholding, keep)
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
        attn = attn.mean(dim=2)[:, :, -1].float()  # average the query heads sharing a KV head; 0 on empty slots
        filled = self.pos >= 0
        if self.attn_thresholding:
            attn = (attn >= 1.0 / filled.sum(-1, keepdim=True)).float()
        elif self.attn_top_k < 1.0:
            attn = keep_top_fraction(attn, self.attn_top_k, filled)
        if self.history_window_size == 1:
            self.attn_history.add_(attn.unsqueeze(-1))
            self.attn_counter += filled
        else:
            self.attn_history.index_copy_(3, (self.step % self.history_window_size).view(1), attn.unsqueeze(-1))
            self.attn_counter.copy_(torch.clamp(self.attn_counter + filled, max=self.history_window_size))
        self.step.add_(1)

    def reset_state(self):
        self.attn_history.zero_()
        self.attn_counter.zero_()
        self.step.zero_()


def keep_top_fraction(attn: Tensor, fraction: float, filled: Tensor) -> Tensor:
    """Zeroes all but the top `fraction` of each head's attention weights over filled slots."""
    k = max(1, int(math.ceil(fraction * attn.shape[-1])))
    threshold = attn.masked_fill(filled == 0, -1.0).topk(k, dim=-1).values[..., -1:]
    return torch.where(attn >= threshold, attn, torch.zeros_like(attn))


def cpu_flash_attention(query: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Causal attention (heads already repeated for GQA) and each query's log-sum-exp [B, H, T]:
    the kernel behind SDPA on CPU, bit-identical to it, which also returns the log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, True, scale=scale)[:2]


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


class DebugCache(FullCache):
    """debug_<name>: attends with a full cache while a `<name>` cache is fed the same tokens beside it.

    Each decode step records the attention loss: the attention mass (averaged over query heads)
    that falls on tokens the simulated cache no longer holds. Statistics report the simulated
    cache's compression and memory, plus the loss.
    """

    relevant_kwargs = []

    def __init__(self, *args, simulated: KVCache, **kwargs):
        super().__init__(*args, **{**kwargs, "cache_bits": None})
        self.simulated = simulated
        self.register_buffer("attention_loss", torch.zeros(self.max_cache_length))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def return_attn(self):
        return True

    def update_kv(self, input_pos, k, v, is_prefill=False, query=None, **kwargs):
        keys, values, mask = self.simulated.update_kv(input_pos, k, v, is_prefill, query, **kwargs)
        if not is_prefill and self.simulated.return_attn():
            bsz, n_kv, _, head_dim = keys.shape
            q = query.reshape(bsz, n_kv, -1, head_dim)
            _, attn = attention_with_probs(q, keys, values, mask.unsqueeze(2))
            self.simulated.update_state(input_pos, k, v, False, attn.unsqueeze(3))
        return super().update_kv(input_pos, k, v, is_prefill, query, **kwargs)

    def update_state(self, input_pos, k, v, is_prefill, attn):
        held = torch.zeros_like(self.pos, dtype=torch.float)
        simulated_pos = self.simulated.pos
        held.scatter_add_(2, simulated_pos.clamp(min=0), (simulated_pos >= 0).float())  # empties add 0
        held_slots = held.gather(2, self.pos.clamp(min=0)) * (self.pos >= 0)
        lost_mass = (attn[:, :, :, -1].float() * (1.0 - held_slots).unsqueeze(2)).sum(-1)
        self.attention_loss.index_put_((self.steps,), lost_mass.mean())
        self.steps.add_(1)

    def reset_state(self):
        self.simulated.reset()
        self.attention_loss.zero_()
        self.steps.zero_()

    def compute_statistics(self, seq_len):
        stats = self.simulated.compute_statistics(seq_len)
        losses = self.attention_loss[: int(self.steps)]
        stats["attention_loss"] = losses.mean().item() if len(losses) else 0.0
        for first in range(500, len(losses) + 1, 500):
            stats[f"attention_loss_first_{first}"] = losses[:first].mean().item()
        return stats


HYBRID_POLICY_PARTS = ("special", "punc", "heavy_hitter", "window", "full")
FASTGEN_STRATEGIES = [
    "special",
    "special_punc",
    "special_punc_heavy_hitter",
    "special_punc_heavy_hitter_window",
    "full",
]


def parse_hybrid_policy(name: str) -> set[str]:
    """'special_punc_heavy_hitter' -> {'special', 'punc', 'heavy_hitter'}."""
    parts, rest = set(), name
    for part in HYBRID_POLICY_PARTS:
        if part in rest:
            parts.add(part)
            rest = rest.replace(part, "")
    if rest.strip("_") or not parts:
        raise ValueError(
            f"unknown hybrid policy '{name}'; combine {', '.join(HYBRID_POLICY_PARTS)} with '_' (e.g. special_punc)"
        )
    return parts


class HybridCache(KVCache):
    """FastGen: each KV head profiles the prompt and adopts the cheapest policy that still recovers
    `min_recovery_frac` of its attention; heads then keep different tokens (and numbers of them).

    The cache spans the whole sequence; a token a head's policy drops is masked out for good.
    `window` keeps the most recent WINDOW_FRACTION of tokens, `heavy_hitter` the
    HEAVY_HITTER_FRACTION with the most accumulated attention.
    """

    relevant_kwargs = ["min_recovery_frac", "hybrid_strategies", "global_tokens", "cache_bits"]
    head_specific = True
    WINDOW_FRACTION = 0.3
    HEAVY_HITTER_FRACTION = 0.3
    PROFILE_QUERIES = 32

    def __init__(
        self, *args, min_recovery_frac=0.9, hybrid_strategies=None, special_ids=(), punctuation_ids=(), **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.min_recovery_frac = min_recovery_frac
        self.strategies = list(hybrid_strategies or FASTGEN_STRATEGIES)
        policies = [parse_hybrid_policy(s) for s in self.strategies]
        # One row per policy: which parts it combines, in HYBRID_POLICY_PARTS order.
        table = [[part in p for part in HYBRID_POLICY_PARTS] for p in policies] + [[False] * 4 + [True]]
        self.register_buffer("policy_parts", torch.tensor(table))
        self.register_buffer("special_ids", torch.tensor(sorted(special_ids), dtype=torch.long))
        self.register_buffer("punctuation_ids", torch.tensor(sorted(punctuation_ids), dtype=torch.long))
        self.register_buffer("policy", torch.zeros(self.pos.shape[:2], dtype=torch.long))
        self.register_buffer("kept", torch.zeros(self.pos.shape, dtype=torch.bool))
        self.register_buffer("is_special", torch.zeros(self.pos.shape, dtype=torch.bool))
        self.register_buffer("is_punc", torch.zeros(self.pos.shape, dtype=torch.bool))
        self.register_buffer("attn_sum", torch.zeros(self.pos.shape))

    def return_attn(self):
        return True

    def update_kv(self, input_pos, k, v, is_prefill=False, query=None, token_ids=None, **kwargs):
        self.new_token_ids = token_ids  # read by insert_state
        keys, values, filled = super().update_kv(input_pos, k, v, is_prefill, query)
        if is_prefill:
            self.profile(input_pos, observation_attention(query, k, self.PROFILE_QUERIES))
        self.kept &= self.policy_mask(input_pos[-1:])
        return keys, values, filled & self.kept

    def insert_state(self, slots, k, state):
        """Marks new tokens special/punctuation and kept; token ids arrive with the write."""
        rows = self.flat_rows(slots)
        self.write_rows(self.kept, rows, True)
        self.write_rows(self.attn_sum, rows, 0.0)
        ids = self.new_token_ids.view(1, 1, -1).expand_as(slots)
        self.write_rows(self.is_special, rows, torch.isin(ids, self.special_ids))
        self.write_rows(self.is_punc, rows, torch.isin(ids, self.punctuation_ids))

    def policy_mask(self, input_pos: Tensor, policy_parts: Tensor | None = None) -> Tensor:
        """Which slots each head's policy keeps at position input_pos, [B, H, L] (or [P, B, H, L])."""
        parts = self.policy_parts[self.policy] if policy_parts is None else policy_parts
        special, punc, heavy, window, full = (parts[..., i, None] for i in range(len(HYBRID_POLICY_PARTS)))
        length = (input_pos + 1).float()
        recent = self.pos >= input_pos + 1 - torch.ceil(self.WINDOW_FRACTION * length)
        filled = self.pos >= 0
        score = torch.where(filled & self.kept, self.attn_sum, -math.inf)
        rank = score.argsort(dim=-1, descending=True).argsort(dim=-1)
        top = rank < torch.ceil(self.HEAVY_HITTER_FRACTION * length)
        keep = full | (special & self.is_special) | (punc & self.is_punc) | (window & recent) | (heavy & top)
        return keep | (self.pos < self.global_tokens) | (self.pos == input_pos)

    def profile(self, input_pos: Tensor, attn: Tensor) -> None:
        """Each head takes the first policy whose kept prompt tokens recover min_recovery_frac of the
        attention [B, H, W, T] of the last W prompt queries; the prompt fills slots 0..T-1 in order."""
        seqlen = attn.shape[-1]
        self.attn_sum[..., :seqlen] = attn.sum(2)
        masks = self.policy_mask(input_pos[-1:], self.policy_parts.view(-1, 1, 1, len(HYBRID_POLICY_PARTS)))
        masks = masks[..., :seqlen]
        recovered = (attn.unsqueeze(0) * masks.unsqueeze(3)).sum(-1).mean(-1) / attn.sum(-1).mean(-1)
        recovered[-1] = 1.0  # the implicit full fallback
        good = recovered >= self.min_recovery_frac
        self.policy.copy_(good.float().argmax(dim=0))

    def update_state(self, input_pos, k, v, is_prefill, attn):
        self.attn_sum += attn.mean(dim=2)[:, :, -1].float()

    def reset_state(self):
        for name in ("policy", "kept", "is_special", "is_punc", "attn_sum"):
            getattr(self, name).zero_()

    def compute_statistics(self, seq_len):
        stats = super().compute_statistics(seq_len)
        kept = (self.kept & (self.pos >= 0)).sum(-1).float() * (self.cache_bits or 16) / 16
        stats["compression_ratio"] = ((seq_len - kept) / seq_len).mean().item()
        names = self.strategies + ["full"]
        shares = torch.bincount(self.policy.flatten(), minlength=len(names)).float() / self.policy.numel()
        stats["policy_share"] = {}
        for name, share in zip(names, shares.tolist()):
            stats["policy_share"][name] = stats["policy_share"].get(name, 0.0) + share
        return stats


def observation_attention(query: Tensor, k: Tensor, window: int) -> Tensor:
    """Attention [B, H_kv, W, T] of the last `window` prompt queries, averaged over each KV head's query heads."""
    bsz, n_head, seqlen, head_dim = query.shape
    n_kv = k.shape[1]
    window = max(1, min(window, seqlen))
    q = query[:, :, -window:].float().reshape(bsz, n_kv, n_head // n_kv, window, head_dim)
    scores = q @ k.float().unsqueeze(2).transpose(-1, -2) / math.sqrt(head_dim)
    rows = torch.arange(seqlen - window, seqlen, device=k.device)
    causal = torch.arange(seqlen, device=k.device).view(1, -1) <= rows.view(-1, 1)
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).mean(dim=2)


CACHE_STRATEGIES: dict[str, type[KVCache]] = {
    "full": FullCache,
    "recent_global": RecentGlobalCache,
    "random": RandomCache,
    "l2": L2Cache,
    "heavy_hitter": HeavyHitterCache,
    "keep_it_odd": KeepItOddCache,
    "hybrid": HybridCache,
}


def resolve_recent_window(recent_window: float, cache_length: int, global_tokens: int) -> int:
    """A window below 1 is a fraction of the cache; it never covers every evictable slot."""
    window = int(recent_window * cache_length) if recent_window < 1 else int(recent_window)
    return max(0, min(window, cache_length - global_tokens - 1))


def get_cache_constructor(name: str) -> type[KVCache]:
    """A strategy class; `debug_<name>` gives DebugCache (create_caches builds its simulated `<name>`)."""
    if name.startswith("debug_") and name.removeprefix("debug_") in CACHE_STRATEGIES:
        return DebugCache
    if name not in CACHE_STRATEGIES:
        raise ValueError(f"unknown cache strategy '{name}'; choose from: {', '.join(CACHE_STRATEGIES)}")
    return CACHE_STRATEGIES[name]


# -- the cache_args argument group ------------------------------------------------------------
def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cache_args")
    group.add_argument("--max_cache_length", type=float, nargs="+", default=[1.0],
                       help="per-layer cache size: (0, 1] = fraction of prompt + max_new_tokens, > 1 = tokens")  # fmt: skip
    group.add_argument("--cache_length_pattern", default="tile", choices=PATTERNS)
    group.add_argument("--cache_strategy", nargs="+", default=["full"])
    group.add_argument("--cache_strategy_pattern", default="tile", choices=("tile", "repeat"))
    group.add_argument("--prompt_compression_strategy", nargs="+", default=["recent_global"])
    group.add_argument("--feed_long_prompts", action="store_true", help="feed the prompt tail one token at a time")
    group.add_argument("--global_tokens", type=int, default=1)
    group.add_argument("--recent_window", type=float, default=10, help="< 1 = fraction of the cache length")
    group.add_argument("--history_window_size", type=int, default=1)
    group.add_argument("--attn_thresholding", action="store_true")
    group.add_argument("--attn_top_k", type=float, default=1.0,
                       help="heavy_hitter: record only the top fraction of attention weights")  # fmt: skip
    group.add_argument("--min_recovery_frac", type=float, default=0.9)
    group.add_argument("--cache_bits", type=int, default=None)
    group.add_argument("--cache_config", default=None, help="YAML preset in cache_configs/ (name or path)")


def cache_argument_names() -> list[str]:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return [a.dest for a in parser._actions if a.dest != "help"]


# Also passed to caches: hybrid's policy list and the tokenizer's special/punctuation ids.
CACHE_ARGUMENT_NAMES = cache_argument_names() + ["hybrid_strategies", "special_ids", "punctuation_ids"]


def add_token_ids(cache_kwargs: dict, tokenizer) -> dict:
    """The hybrid strategy keeps special and punctuation tokens: hand it the tokenizer's ids."""
    if "hybrid" not in cache_kwargs["cache_strategy"]:
        return cache_kwargs
    return {**cache_kwargs, "special_ids": tokenizer.special_ids, "punctuation_ids": tokenizer.punctuation_ids}


def default_cache_kwargs(**overrides) -> dict:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    kwargs = vars(parser.parse_args([]))
    unknown = set(overrides) - set(kwargs)
    if unknown:
        raise ValueError(f"not cache arguments: {', '.join(sorted(unknown))}")
    return {**kwargs, **overrides}


def load_cache_config(name: str) -> dict:
    """Reads a YAML preset: an existing path (with a slash or .yaml) from anywhere, else a name in cache_configs/."""
    if ("/" in name or name.endswith((".yaml", ".yml"))) and Path(name).is_file():
        path = Path(name)
    else:
        path = (CACHE_CONFIG_DIR / name).with_suffix(".yaml") if not name.endswith(".yaml") else CACHE_CONFIG_DIR / name
        if CACHE_CONFIG_DIR.resolve() not in path.resolve().parents:
            raise ValueError(f"cache config '{name}' is outside {CACHE_CONFIG_DIR}; pass a path instead")
    if not path.is_file():
        choices = ", ".join(sorted(p.stem for p in CACHE_CONFIG_DIR.glob("*.yaml")))
        raise ValueError(f"cache config '{name}' not found; choose from: {choices}, or give a path to a YAML file")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"cache config {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise ValueError(f"cache config {path} must be a mapping of cache arguments")
    allowed = set(cache_argument_names()) | {"hybrid_strategies"}
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ValueError(
            f"cache config {path}: '{unknown[0]}' is not a cache argument; allowed: {', '.join(sorted(allowed))}"
        )
    for key in ("max_cache_length", "cache_strategy", "prompt_compression_strategy"):
        if key in config and not isinstance(config[key], list):
            config[key] = [config[key]]
    return config


def parse_args_with_cache_config(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Command-line flags beat the preset, the preset beats the defaults."""
    args, _ = parser.parse_known_args(argv)
    if args.cache_config:
        try:
            config = load_cache_config(args.cache_config)
        except ValueError as e:
            parser.exit(2, f"error: {e}\n")
        parser.set_defaults(**config)
        args = parser.parse_args(argv)
        for key, value in config.items():
            if not hasattr(args, key):
                setattr(args, key, value)
        return args
    return parser.parse_args(argv)


# -- per-layer layout -------------------------------------------------------------------------
def spread_over_layers(values: list, n_layer: int, pattern: str, name: str) -> list:
    """`tile`: the first layers take the first value ...; `repeat`: values alternate layer by layer."""
    if n_layer % len(values):
        raise ValueError(f"{len(values)} values of --{name} do not divide the {n_layer} layers; give 1 or a divisor")
    if pattern == "repeat":
        return [values[i % len(values)] for i in range(n_layer)]
    per = n_layer // len(values)
    return [values[i // per] for i in range(n_layer)]


def layer_cache_lengths(cache_kwargs: dict, n_layer: int, prompt_length: int, max_new_tokens: int) -> list[int]:
    """Absolute cache length per layer: rounded up to a multiple of 8, at most the sequence length."""
    seq_len = prompt_length + max_new_tokens
    values, pattern = cache_kwargs["max_cache_length"], cache_kwargs["cache_length_pattern"]
    tokens = [v * seq_len if v <= 1 else v for v in values]
    if pattern in ("pyramid", "funnel"):
        if len(tokens) != 1:
            raise ValueError(f"--cache_length_pattern {pattern} takes one (average) --max_cache_length")
        # Linear from 1.5x the average in the first layer to 0.5x in the last (reversed for funnel).
        slope = [1.5 - i / (n_layer - 1) if n_layer > 1 else 1.0 for i in range(n_layer)]
        tokens = [tokens[0] * s for s in (slope if pattern == "pyramid" else slope[::-1])]
    else:
        tokens = spread_over_layers(tokens, n_layer, pattern, "max_cache_length")
    return [min(seq_len, 8 * math.ceil(t / 8)) for t in tokens]


def layer_length_values(cache_kwargs: dict, n_layer: int) -> list[float]:
    """The --max_cache_length value each layer gets (before pyramid/funnel shaping)."""
    values = cache_kwargs["max_cache_length"]
    if cache_kwargs["cache_length_pattern"] in ("pyramid", "funnel"):
        return values * n_layer
    return spread_over_layers(values, n_layer, cache_kwargs["cache_length_pattern"], "max_cache_length")


def layer_strategies(cache_kwargs: dict, n_layer: int) -> list[tuple[str, str]]:
    """(cache strategy, prompt compressor) per layer."""
    strategies = cache_kwargs["cache_strategy"]
    compressors = cache_kwargs["prompt_compression_strategy"]
    if len(compressors) == 1:
        compressors = compressors * len(strategies)
    pairs = list(zip(strategies, compressors))
    return spread_over_layers(pairs, n_layer, cache_kwargs["cache_strategy_pattern"], "cache_strategy")


def check_compatibility(cache_kwargs: dict, n_layer: int | None = None, compile: bool = False) -> None:
    """Raises ValueError with a one-line reason for any combination that cannot work (SPEC section 4)."""
    strategies = cache_kwargs["cache_strategy"]
    compressors = cache_kwargs["prompt_compression_strategy"]
    for name in strategies:
        get_cache_constructor(name)
    for name in compressors:
        get_prompt_compressor(name)
    if len(compressors) not in (1, len(strategies)):
        raise ValueError(f"give one --prompt_compression_strategy or one per cache strategy ({len(strategies)})")
    if cache_kwargs["cache_bits"] is not None and cache_kwargs["cache_bits"] not in SUPPORTED_BITS:
        raise ValueError(f"--cache_bits {cache_kwargs['cache_bits']} is not supported; choose from {SUPPORTED_BITS}")
    lengths = cache_kwargs["max_cache_length"]
    if any(v <= 0 for v in lengths):
        raise ValueError("--max_cache_length values must be positive")
    if n_layer is not None:
        spread_over_layers(strategies, n_layer, cache_kwargs["cache_strategy_pattern"], "cache_strategy")
        if cache_kwargs["cache_length_pattern"] in ("pyramid", "funnel"):
            if len(lengths) != 1:
                raise ValueError(f"--cache_length_pattern {cache_kwargs['cache_length_pattern']} takes one length")
        else:
            spread_over_layers(lengths, n_layer, cache_kwargs["cache_length_pattern"], "max_cache_length")
    layer_pairs = (
        zip(strategies, lengths)
        if n_layer is None
        else zip([s for s, _ in layer_strategies(cache_kwargs, n_layer)], layer_length_values(cache_kwargs, n_layer))
    )
    shaped = cache_kwargs["cache_length_pattern"] in ("pyramid", "funnel")  # some layers get < 1.0
    for name, length in layer_pairs:
        # an absolute length would be a cache shorter than the sequence as soon as the prompt outgrows it
        if name in ("full", "hybrid") and (length != 1.0 or shaped):
            raise ValueError(
                f"the {name} cache spans the whole sequence; use --max_cache_length 1.0 with it "
                + ("(its policies do the compressing)" if name == "hybrid" else "or a compressing strategy")
            )
    if "hybrid" in strategies:
        if compile:
            raise ValueError("the hybrid strategy changes shapes per head and cannot be compiled; drop --compile")
        for policy in cache_kwargs.get("hybrid_strategies") or FASTGEN_STRATEGIES:
            parse_hybrid_policy(policy)
    absolute = [v for v in lengths if v > 1]
    if absolute and cache_kwargs["global_tokens"] >= min(absolute):
        raise ValueError(
            f"--global_tokens {cache_kwargs['global_tokens']} exceeds a cache of {int(min(absolute))} slots"
        )
    pairs = list(zip(strategies, compressors * len(strategies) if len(compressors) == 1 else compressors))
    for cache_name, compressor_name in pairs:
        cache_class = CACHE_STRATEGIES[cache_name.removeprefix("debug_")]
        if prompt_compressor_is_head_specific(compressor_name) and not cache_class.head_specific:
            raise ValueError(
                f"prompt compressor '{compressor_name}' keeps different tokens per head but cache '{cache_name}' "
                "keeps the same tokens for all heads; pick a head-constant compressor (recent_global, random, keep_it_odd)"
            )


def check_cache_lengths(cache_kwargs: dict, n_layer: int, prompt_length: int, max_new_tokens: int) -> None:
    """The compatibility checks that need the prompt length: run after tokenizing, before the model loads."""
    lengths = layer_cache_lengths(cache_kwargs, n_layer, prompt_length, max_new_tokens)
    prefilled = min(prompt_length, min(lengths)) if cache_kwargs.get("feed_long_prompts") else prompt_length
    for length, (_, compressor) in zip(lengths, layer_strategies(cache_kwargs, n_layer)):
        if length <= cache_kwargs["global_tokens"]:
            raise ValueError(f"--global_tokens {cache_kwargs['global_tokens']} exceeds a cache of {length} slots")
        if compressor == "full" and prefilled > length:
            raise ValueError(
                f"prompt of {prompt_length} tokens does not fit a {length}-slot cache with prompt compression "
                "'full'; choose another --prompt_compression_strategy or a larger --max_cache_length"
            )


def create_caches(
    cache_kwargs: dict,
    n_layer: int,
    n_heads: int,
    head_dim: int,
    prompt_length: int,
    max_new_tokens: int,
    device,
    dtype: torch.dtype,
    max_batch_size: int = 1,
) -> list[KVCache]:
    """One cache per layer, sized and typed by the per-layer patterns."""
    lengths = layer_cache_lengths(cache_kwargs, n_layer, prompt_length, max_new_tokens)
    seq_len = prompt_length + max_new_tokens
    caches = []
    for length, (strategy, compressor) in zip(lengths, layer_strategies(cache_kwargs, n_layer)):
        if length <= cache_kwargs["global_tokens"]:
            raise ValueError(f"--global_tokens {cache_kwargs['global_tokens']} exceeds a cache of {length} slots")
        kwargs = {k: v for k, v in cache_kwargs.items() if k in CACHE_ARGUMENT_NAMES and k != "max_cache_length"}
        kwargs["prompt_compressor"] = get_prompt_compressor(compressor)(
            global_tokens=cache_kwargs["global_tokens"],
            recent_window=resolve_recent_window(cache_kwargs["recent_window"], length, cache_kwargs["global_tokens"]),
        )
        if strategy.startswith("debug_"):
            simulated = get_cache_constructor(strategy.removeprefix("debug_"))(
                max_batch_size, n_heads, head_dim, length, dtype, **kwargs
            )
            cache = DebugCache(max_batch_size, n_heads, head_dim, seq_len, dtype, simulated=simulated, **kwargs)
        else:
            cache = get_cache_constructor(strategy)(max_batch_size, n_heads, head_dim, length, dtype, **kwargs)
        caches.append(cache.to(device))
    return caches


def cache_statistics(caches: list[KVCache], seq_len: int) -> dict:
    """Averaged and per-layer statistics (SPEC section 7)."""
    per_layer = [c.compute_statistics(seq_len) for c in caches]
    stats = {}
    for key in dict.fromkeys(k for s in per_layer for k in s):
        values = [s[key] for s in per_layer if key in s]
        if key == "cache_memory_bytes":
            stats[key] = sum(values)
        elif isinstance(values[0], dict):  # e.g. hybrid's share of heads per policy
            stats[key] = {name: sum(v.get(name, 0.0) for v in values) / len(values) for name in values[0]}
        else:
            stats[key] = sum(values) / len(values)
        stats[f"{key}_per_layer"] = values
    return stats


def relevant_kwargs(cache_kwargs: dict) -> dict:
    """The hyper-parameters the chosen strategies actually read (names result folders)."""
    names = ["cache_strategy", "prompt_compression_strategy"]
    for strategy in cache_kwargs["cache_strategy"]:
        names += CACHE_STRATEGIES[strategy.removeprefix("debug_")].relevant_kwargs
    if len(cache_kwargs["max_cache_length"]) > 1 or cache_kwargs["cache_length_pattern"] in ("pyramid", "funnel"):
        names.append("cache_length_pattern")
    if len(cache_kwargs["cache_strategy"]) > 1:
        names.append("cache_strategy_pattern")
    if cache_kwargs.get("feed_long_prompts"):
        names.append("feed_long_prompts")
    return {n: cache_kwargs.get(n) for n in dict.fromkeys(names)}
