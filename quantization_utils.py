"""Low-bit asymmetric quantization of KV-cache vectors, with codes bit-packed into bytes.

Every function is built from plain tensor ops with shapes fixed by ``bits`` and the input
shape (no ``.item()``, no data-dependent branches), so it runs on any device and traces into a
single ``torch.compile(fullgraph=True)`` graph inside the decode step.

Packing layout is planar: with ``n = 8 // bits`` codes per byte, byte ``i`` holds codes
``i, i + D/n, ..., i + (n-1)D/n`` from low to high bits. Unlike interleaving neighbours, this makes
both directions contiguous slice/concat ops, which are cheaper in eager mode on CPU.
"""

import math
from typing import NamedTuple

import torch
from torch import Tensor

SUPPORTED_BITS = (2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def packed_dim(head_dim: int, bits: int) -> int:
    """Last-dim size of the packed buffer, so caches can allocate storage before any data."""
    _check_bits(bits)
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8, got {head_dim}")
    return head_dim * bits // 8


def pack(codes: Tensor, bits: int) -> Tensor:
    """Squeeze ``8 // bits`` codes (each < 2**bits) into every byte of the last dim.

    Packs with ``+``/``*`` rather than ``|``/``<<`` so that ``codes`` may be any integer-valued
    tensor: :func:`quantize` hands over its float codes and only the packed bytes get cast, which
    saves a full-size float -> uint8 cast (a slow one on CPU).
    """
    packed_dim(codes.shape[-1], bits)
    chunks = codes.chunk(8 // bits, dim=-1)
    packed = chunks[0]
    for j in range(1, len(chunks)):
        packed = packed + chunks[j] * (1 << (j * bits))
    return packed.to(torch.uint8)


def _code_chunks(packed: Tensor, bits: int) -> list[Tensor]:
    """The bit fields of ``packed``, lowest first. The lowest needs no shift and the highest no mask:
    in eager mode every op skipped is a pass over the whole cache saved at each decode step."""
    _check_bits(bits)
    mask = (1 << bits) - 1
    chunks = []
    for shift in range(0, 8, bits):
        field = packed >> shift if shift else packed
        chunks.append(field if shift + bits == 8 else field & mask)
    return chunks


def unpack(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack`."""
    return torch.cat(_code_chunks(packed, bits), dim=-1)


def _round_up_to(v: Tensor, dtype: torch.dtype) -> Tensor:
    """Round non-negative float32 ``v`` up to the nearest value with ``dtype``'s mantissa width.

    Done with integer ops on the bit pattern because inductor drops float32 -> bfloat16 -> float32
    round trips inside fused kernels, which would make compiled and eager codes disagree. Exact
    for bfloat16 and float32, and for float16 outside its subnormal range; wider dtypes keep the
    float32 value.
    """
    drop = max(0, 23 - round(-math.log2(torch.finfo(dtype).eps)))
    mask = (1 << drop) - 1
    return ((v.view(torch.int32) + mask) & ~mask).view(torch.float32)


def quantize(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize each last-dim vector of ``x`` onto ``2**bits`` levels spanning its own min..max.

    One (scale, zero) pair per vector keeps outlier channels of one token from costing precision
    in the others. The pair is returned in ``x``'s dtype (it is what the cache stores); the scale
    is rounded up to that dtype before the codes are chosen, so the stored grid is exactly the one
    used and still reaches the maximum. A constant vector gets scale 0 and decodes exactly.
    """
    qmax = (1 << bits) - 1
    xf = x.float()
    # amin + amax is faster than aminmax on CPU.
    lo, hi = xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True)
    scale = _round_up_to((hi - lo) / qmax, x.dtype)
    inv_scale = 1.0 / scale.clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((xf - lo) * inv_scale).round_().clamp_(0, qmax)
    return pack(codes, bits), scale.to(x.dtype), lo.to(x.dtype)


def dequantize(packed: Tensor, scale: Tensor, zero: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """Rebuild ``codes * scale + zero`` for attention, in float32 so only the final cast rounds.

    Decodes each packed bit field straight to ``dtype`` and concatenates those, instead of
    unpacking to uint8 codes first; compiled, that is one vectorized kernel.
    """
    scale, zero = scale.float(), zero.float()
    return torch.cat([(c.float() * scale + zero).to(dtype) for c in _code_chunks(packed, bits)], dim=-1)


class QuantizedTensor(NamedTuple):
    """What a low-bit cache hands attention: packed codes [..., L, D * bits / 8], scale and zero [..., L, 1]."""

    packed: Tensor
    scale: Tensor
    zero: Tensor
    bits: int


def quantized_scores(q: Tensor, k: QuantizedTensor) -> Tensor:
    """q [..., G, D] @ dequantize(k)^T in float32, without materializing the dequantized keys.

    q . (codes * s + z) = s * (q . codes) + z * sum(q): each packed bit field holds a contiguous
    slice of the head dimension (planar layout), so it multiplies the matching slice of q.
    """
    qf = q.float()
    q_slices = qf.chunk(8 // k.bits, dim=-1)
    dots = sum(qs @ c.float().transpose(-1, -2) for qs, c in zip(q_slices, _code_chunks(k.packed, k.bits)))
    return dots * k.scale.float().transpose(-1, -2) + exact_sum(qf) * k.zero.float().transpose(-1, -2)


def quantized_weighted_sum(probs: Tensor, v: QuantizedTensor) -> Tensor:
    """probs [..., G, L] @ dequantize(v) in float32: (probs * s) @ codes + probs @ z, slice by slice."""
    probs = probs.float()
    scaled = probs * v.scale.float().transpose(-1, -2)
    out = torch.cat([scaled @ c.float() for c in _code_chunks(v.packed, v.bits)], dim=-1)
    return out + exact_sum(probs * v.zero.float().transpose(-1, -2))


def exact_sum(x: Tensor) -> Tensor:
    """Float32 sum over the last dim, accumulated in float64 so any summation order rounds alike:
    inductor turns a one-column matmul into its own reduction, and with float32 sums compiled and
    eager 4-bit decode would round the zero-point term differently."""
    return x.to(order_free_dtype(x.device)).sum(-1, keepdim=True).float()


def order_free_dtype(device: torch.device) -> torch.dtype:
    """float64, whose sums of float32 terms round to the same float32 in any order; MPS has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def dense(x) -> Tensor:
    """A cache's keys or values as a tensor: a QuantizedTensor dequantized to its scales' dtype."""
    if isinstance(x, QuantizedTensor):
        return dequantize(x.packed, x.scale, x.zero, x.bits, x.scale.dtype)
    return x
