"""Attention math shared by the model, the caches and the strategies: rotary embeddings, attention
over cache slots, the probabilities scoring caches read, prompt attention with the attention each key
received, and the attention of the last queries of a window. Plain torch; imports nothing of ours but
the low-bit cache's tensor type."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from quantization_utils import QuantizedTensor, quantized_scores, quantized_weighted_sum

# Query rows per chunk when prefill needs attention probabilities: bounds memory at
# PREFILL_CHUNK_ELEMENTS floats instead of heads x seq x seq.
PREFILL_CHUNK_ELEMENTS = 1 << 22


# -- rotary position embeddings ----------------------------------------------------------------
def apply_rope_scaling(freqs: Tensor, rope_scaling: dict) -> Tensor:
    """Llama-3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, smooth between."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, smoothed)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rope_frequencies(n_elem: int, base: float, rope_scaling: dict | None = None) -> Tensor:
    """The rotary angle per position of each of the n_elem / 2 pairs, float64; scaled by Llama 3.1's
    rule, or linearly (positions divided by `factor`: Gemma 3's global layers)."""
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: n_elem // 2] / n_elem))
    rope_type = (rope_scaling or {}).get("rope_type", "llama3")
    if rope_scaling and rope_type == "linear":
        freqs = freqs / rope_scaling["factor"]
    elif rope_scaling and rope_type == "llama3":
        freqs = apply_rope_scaling(freqs, rope_scaling)
    return freqs


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float, rope_scaling: dict | None = None) -> Tensor:
    freqs = rope_frequencies(n_elem, base, rope_scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).float()


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotates pairs (x[i], x[i + d/2]) -- the HF layout, so HF weights load without permutation."""
    half = x.shape[-1] // 2
    cos = freqs_cis[..., 0].view(-1, x.size(1), 1, half)  # [1, T, ...] shared, or [B, 1, ...] per sequence
    sin = freqs_cis[..., 1].view(-1, x.size(1), 1, half)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


# -- causal attention, global or within a sliding window ------------------------------------------
def sliding_window_mask(query_pos: Tensor, key_pos: Tensor, window: int | None) -> Tensor:
    """Which keys each query sees [..., T, S]: those at or before its position (query_pos [..., T],
    key_pos [..., S]), and with a `window` only those less than `window` positions back."""
    distance = query_pos.unsqueeze(-1) - key_pos.unsqueeze(-2)
    visible = distance >= 0
    return visible if window is None else visible & (distance < window)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """Causal attention of a prompt's queries [B, H_q, T, D] over its keys and values [B, H_kv, T, D]
    (grouped heads); with a `window` a query sees only the `window` most recent keys, itself included.
    A windowed prompt goes by blocks of `window` queries, each over the keys it can see (at most
    2 x window), so memory grows with the prompt, not its square."""
    if window is None or q.shape[2] <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return windowed_attention_by_blocks(q, k, v, window)


@torch.compiler.disable  # a Python loop over the prompt's blocks: compiling it would unroll every block
def windowed_attention_by_blocks(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    seqlen = q.shape[2]
    pos = torch.arange(seqlen, device=q.device)
    blocks = []
    for start in range(0, seqlen, window):
        end, first = min(start + window, seqlen), max(0, start - window + 1)
        mask = sliding_window_mask(pos[start:end], pos[first:end], window)
        blocks.append(
            F.scaled_dot_product_attention(
                q[:, :, start:end], k[:, :, first:end], v[:, :, first:end], attn_mask=mask, enable_gqa=True
            )
        )
    return torch.cat(blocks, dim=2)


# -- attention over cache slots ----------------------------------------------------------------
def slot_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Softmax attention of q [B, H, G, D] (one token's G query heads per KV head) over keys and values
    [B, H, S, D] at the slots where mask [B, H, S] is true."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(2))


@torch.library.custom_op("kvwb::softmax", mutates_args=())
def opaque_softmax(x: Tensor) -> Tensor:
    return torch.softmax(x, dim=-1)


@opaque_softmax.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def softmax_as_eager(x: Tensor) -> Tensor:
    """Softmax over the last dim that rounds alike eager and compiled: compiled, eager's kernel behind
    a custom op, since inductor's fused softmax sums in another order and caches that weight or score
    tokens by the probabilities would then give compiled greedy tokens unlike eager's; eager,
    torch.softmax itself, without the custom op's dispatch cost."""
    return opaque_softmax(x) if torch.compiler.is_compiling() else torch.softmax(x, dim=-1)


def attention_probs(q: Tensor, k, mask: Tensor) -> Tensor:
    """Softmax attention probabilities of q over k where mask is true, for caches that score tokens by
    attention; float32 scores and sums whatever the dtype. k may be a low-bit cache's QuantizedTensor:
    the dequantization folds into the product."""
    if isinstance(k, QuantizedTensor):
        scores = quantized_scores(q, k)
    else:
        scores = q.float() @ k.float().transpose(-1, -2)
    return softmax_as_eager(torch.where(mask, scores * (1.0 / math.sqrt(q.shape[-1])), float("-inf")))


def attention_with_probs(q: Tensor, k, v, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Attention computed from attention_probs, and those probabilities: for a low-bit cache, whose
    QuantizedTensor values no fused kernel takes (the dequantization folds into the two products)."""
    probs = attention_probs(q, k, mask)
    if isinstance(v, QuantizedTensor):
        return quantized_weighted_sum(probs, v).to(q.dtype), probs
    return (probs @ v.float()).to(v.dtype), probs


def window_attention(key_pos: Tensor, k: Tensor, query: Tensor, window: int) -> Tensor:
    """Attention [B, H_kv, G, W, S] of the last W = `window` queries [B, H_q, T, D] (those of the last
    candidates) to keys k [B, H_kv, S, D] at key_pos ([B or 1, H or 1,] S; -1: empty), float32: what
    SnapKV, TOVA and FastGen's profiling score the prompt by."""
    bsz, n_head, _, head_dim = query.shape
    n_kv = k.shape[1]
    window = max(1, min(window, query.shape[2]))
    q = query[:, :, -window:].float().view(bsz, n_kv, n_head // n_kv, window, head_dim)
    scores = q @ k.float().unsqueeze(2).transpose(-1, -2) / math.sqrt(head_dim)
    key_pos = key_pos.view(*[1] * (3 - key_pos.dim()), *key_pos.shape).unsqueeze(2).unsqueeze(2)
    query_pos = key_pos[..., -window:].transpose(-1, -2)  # the queries are the last candidates
    visible = (key_pos <= query_pos) & (key_pos >= 0)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


def pooled(scores: Tensor, kernel: int) -> Tensor:
    """Scores [B, H, S] smoothed by a 1-D average over `kernel` neighbours (SnapKV's pooling)."""
    return F.avg_pool1d(scores, kernel, stride=1, padding=kernel // 2)


# -- the prompt's attention, with what each key received ---------------------------------------------
def score_dtype(x: Tensor) -> torch.dtype:
    """The dtype of score products over x: float32 on CPU for half precision (the upcast is exact and
    many CPUs only emulate half-precision products), else x's own."""
    return torch.float32 if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) else x.dtype


def cpu_flash_attention(
    query: Tensor, k: Tensor, v: Tensor, scale: float | None = None, causal: bool = True
) -> tuple[Tensor, Tensor]:
    """Attention (heads already repeated for GQA) and each query's log-sum-exp [B, H, T]: the kernel
    behind SDPA on CPU, bit-identical to it, which also returns the log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, causal, scale=scale)[:2]


def attention_and_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> tuple[Tensor, Tensor]:
    """Attention output [B, H, T, D] and the log-sum-exp of each query's scaled scores [B, H, T]; on CPU
    the fused kernel (no probability matrix), elsewhere from the scores."""
    if q.device.type == "cpu":
        return cpu_flash_attention(q, k, v, causal=causal)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(), -math.inf)
    lse = scores.logsumexp(dim=-1)
    return ((scores - lse.unsqueeze(-1)).exp() @ v.float()).to(q.dtype), lse


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
    work = score_dtype(k)
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
