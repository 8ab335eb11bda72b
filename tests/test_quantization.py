import pytest
import torch

from quantization_utils import (
    SUPPORTED_BITS,
    QuantizedTensor,
    dequantize,
    pack,
    packed_dim,
    quantize,
    quantized_scores,
    quantized_weighted_sum,
    unpack,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _kv_like(shape, dtype, device, seed=0):
    """Per-vector spread and offset differ, as keys do across tokens, to exercise asymmetry."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 4
    x = x + torch.randn(*shape[:-1], 1, generator=g) * 3
    return x.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_unpack_round_trip(bits, device):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (2, 3, 5, 64), generator=g, dtype=torch.uint8).to(device)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, 3, 5, packed_dim(64, bits))
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_error_within_half_step(bits, dtype, device):
    x = _kv_like((2, 3, 37, 64), dtype, device)
    packed, scale, zero = quantize(x, bits)
    assert scale.shape == zero.shape == (2, 3, 37, 1)
    assert scale.dtype == zero.dtype == dtype
    out = dequantize(packed, scale, zero, bits, dtype)
    assert out.shape == x.shape and out.dtype == dtype

    xf = x.float()
    half_step = (xf.amax(-1, keepdim=True) - xf.amin(-1, keepdim=True)) / (2**bits - 1) / 2
    amax = xf.abs().amax(-1, keepdim=True)
    eps = torch.finfo(dtype).eps
    # Decoded in float32, only the grid counts: its step is the scale rounded up to `dtype`.
    grid = dequantize(packed, scale, zero, bits, torch.float32)
    tol = half_step * (1 + eps) + torch.finfo(torch.float32).eps * amax
    err = (grid - xf).abs().amax(-1, keepdim=True)
    assert (err <= tol).all(), (err - tol).max()
    # Decoded in `dtype`, rounding the result adds up to eps/2 of its magnitude.
    err = (out.float() - xf).abs().amax(-1, keepdim=True)
    assert (err <= tol + eps * amax).all(), (err - tol - eps * amax).max()


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_packed_bytes_are_bits_over_16_of_bf16(bits):
    x = _kv_like((1, 3, 128, 64), torch.bfloat16, "cpu")
    packed, scale, zero = quantize(x, bits)
    bf16_bytes = x.numel() * x.element_size()
    assert packed.numel() * packed.element_size() * 16 == bf16_bytes * bits
    # scale and zero: one bf16 each per vector, on top of the codes.
    vectors = x.numel() // x.shape[-1]
    assert scale.numel() * scale.element_size() == zero.numel() * zero.element_size() == vectors * 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_constant_vectors_round_trip_exactly(bits, dtype, device):
    x = _kv_like((4, 64), dtype, device)
    x[0] = 0.0
    x[1] = -3.140625
    x[2] = torch.finfo(dtype).max
    packed, scale, zero = quantize(x, bits)
    out = dequantize(packed, scale, zero, bits, dtype)
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all()
    assert torch.isfinite(out).all()
    assert torch.equal(scale[:3], torch.zeros_like(scale[:3]))
    assert torch.equal(out[:3], x[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_decreases_with_bits(dtype):
    x = _kv_like((3, 256, 64), dtype, "cpu")
    errors = [(dequantize(*quantize(x, bits), bits, dtype).float() - x.float()).abs().mean() for bits in SUPPORTED_BITS]
    assert errors[0] > errors[1] > errors[2] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_matches_eager(device):
    # One bit width keeps the compile short; widths change only Python constants, not the ops.
    bits = 4

    def round_trip(x):
        packed, scale, zero = quantize(x, bits)
        return packed, scale, zero, dequantize(packed, scale, zero, bits, x.dtype)

    x = _kv_like((1, 2, 16, 64), torch.bfloat16, device)
    x[0, 0, 0] = 1.5  # a constant vector, through the scale == 0 path
    compiled = torch.compile(round_trip, fullgraph=True)
    for got, want in zip(compiled(x), round_trip(x), strict=True):
        assert torch.equal(got, want)


def test_rejects_unsupported_shapes_and_widths():
    with pytest.raises(ValueError, match="bits"):
        packed_dim(64, 3)
    with pytest.raises(ValueError, match="multiple of 8"):
        packed_dim(60, 4)
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.zeros(2, 64), 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_attention_on_packed_codes_equals_attention_on_dequantized(bits, dtype):
    """Folding scale and zero into the matmuls gives what dequantize-then-matmul gives."""
    k, v = _kv_like((1, 3, 40, 64), dtype, "cpu", seed=1), _kv_like((1, 3, 40, 64), dtype, "cpu", seed=2)
    q = _kv_like((1, 3, 4, 64), dtype, "cpu", seed=3)
    k_q, v_q = QuantizedTensor(*quantize(k, bits), bits), QuantizedTensor(*quantize(v, bits), bits)
    k_deq = dequantize(*k_q, torch.float32)
    v_deq = dequantize(*v_q, torch.float32)
    scores = quantized_scores(q, k_q)
    torch.testing.assert_close(scores, q.float() @ k_deq.transpose(-1, -2), rtol=1e-5, atol=1e-3)
    probs = torch.softmax(scores / 8, dim=-1)
    torch.testing.assert_close(quantized_weighted_sum(probs, v_q), probs @ v_deq, rtol=1e-5, atol=1e-4)
