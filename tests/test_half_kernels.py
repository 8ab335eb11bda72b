"""half_kernels.cpp, the decode kernels of CPUs that emulate half precision: values against exact
float64 references, a sequence's values independent of its batch, masked slots ignored."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_prompt, tiny_transformer

import generation
import one_token
from cache_args import default_cache_kwargs
from one_token import HALF_KERNELS_MISSING

needs_half_kernels = pytest.mark.skipif(
    HALF_KERNELS_MISSING is not None, reason=f"no half_kernels.cpp: {HALF_KERNELS_MISSING}"
)
built_here = pytest.mark.skipif(
    not one_token.HALF_MATMUL_IS_EMULATED or one_token.CPU_CAPABILITY not in one_token.HALF_KERNELS_FLAGS,
    reason="half_kernels.cpp is only built on AVX2 and AVX512 CPUs without half precision",
)
HALF_DTYPES = [torch.bfloat16, torch.float16]
ROOT = Path(__file__).resolve().parent.parent


@built_here
def test_half_kernels_are_built_where_half_precision_is_emulated():
    """CPUs with AVX2 or AVX512 and no half-precision instructions decode through half_kernels.cpp; a
    failed build would leave them on the slower kernels without failing anything else."""
    assert HALF_KERNELS_MISSING is None, f"half_kernels.cpp did not build: {HALF_KERNELS_MISSING}"
    code = "import os; path = os.environ['PATH']; import one_token; print(os.environ['PATH'] == path)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "True", proc.stderr  # the build's PATH for ninja does not outlive it


@built_here
def test_without_a_compiler_one_warning_line_and_the_slower_kernels(tmp_path):
    """No C++ compiler on PATH: the import says so in one line, and decode runs."""
    env = {**os.environ, "PATH": str(tmp_path)}
    env.pop("CXX", None)
    code = (
        "import torch, one_token; from model import Linear; print(one_token.HALF_KERNELS_MISSING); "
        "print(tuple(Linear(16, 8).bfloat16()(torch.randn(3, 1, 16).bfloat16(), decode=True).shape))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["no C++ compiler (c++) on PATH", "(3, 1, 8)"]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: half_kernels.cpp was not built (no C++ compiler"), lines


@needs_half_kernels
def test_a_build_lock_left_by_a_killed_builder_does_not_hang_the_import():
    """torch's lock file, left behind by a builder killed mid-build (a timed-out sweep job), would make
    every later import wait forever."""
    (one_token.HALF_KERNELS_BUILD / "lock").touch()
    code = "import one_token; print(one_token.HALF_KERNELS_MISSING)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
    assert not (one_token.HALF_KERNELS_BUILD / "lock").exists()


def within_rounding(y: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor, n_terms: int) -> bool:
    """|y - exact| within one rounding to y's dtype plus float32's error of a sum of `n_terms` terms
    whose magnitudes sum to `terms`."""
    rounding = torch.finfo(y.dtype).eps / 2 * exact.abs() + torch.finfo(torch.float32).eps * n_terms * terms
    return bool(((y.double() - exact).abs() <= rounding).all())


@needs_half_kernels
@pytest.mark.parametrize("dtype", HALF_DTYPES)
# 101: not a multiple of 8 or 16 lanes; 1541: on AVX2, more than 4 such rows do not fit L1 and take 3 x 4 tiles
@pytest.mark.parametrize(("n_in", "bias"), [(96, True), (101, False), (1541, True)])
def test_half_rows_sums_each_row_in_float32_and_rounds_once_alone_or_in_a_batch(dtype, n_in, bias):
    """Each of 20 rows (more than one block of 8) is within one rounding of the exact product; a row
    gets the same bits alone, in any batch, or from a non-contiguous input."""
    torch.manual_seed(0)
    weight = torch.randn(130, n_in).to(dtype)  # 130 outputs: more than one thread's share
    bias_values = torch.randn(130).to(dtype) if bias else None
    x = torch.randn(20, n_in).to(dtype)
    y = torch.ops.kvwb.half_rows(x, weight, bias_values)
    assert y.shape == (20, 130) and y.dtype == dtype
    exact = x.double() @ weight.double().T + (0 if bias_values is None else bias_values.double())
    assert within_rounding(y, exact, x.double().abs() @ weight.double().abs().T, n_in)
    for rows in (1, 3, 8, 9):
        assert torch.equal(torch.ops.kvwb.half_rows(x[:rows], weight, bias_values), y[:rows])
    assert torch.equal(torch.ops.kvwb.half_rows(x.T.contiguous().T, weight, bias_values), y)


@needs_half_kernels
def test_half_rows_refuses_mismatched_inputs():
    weight = torch.randn(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.kvwb.half_rows(torch.randn(2, 8).half(), weight, None)
    with pytest.raises(RuntimeError, match="weight \\[N, K\\]"):
        torch.ops.kvwb.half_rows(torch.randn(2, 7).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        torch.ops.kvwb.half_rows(torch.randn(2, 8), torch.randn(4, 8), None)


@needs_half_kernels
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize(
    ("batch", "heads", "group", "slots", "head_dim"),
    [(3, 3, 3, 37, 64), (2, 2, 2, 50, 16), (1, 1, 4, 9, 128), (2, 2, 1, 3, 24)],  # dims of 8 to 128 lanes
)
def test_half_decode_attention_is_exact_attention_over_the_visible_slots(dtype, batch, heads, group, slots, head_dim):
    """Within one rounding of float64 attention, per-head and shared masks alike; masked slots holding
    NaN (stale or never written) change nothing; a sequence gets the same bits alone or in a batch."""
    torch.manual_seed(0)
    q = torch.randn(batch, heads, group, head_dim).to(dtype)
    keys, values = (torch.randn(batch, heads, slots, head_dim).to(dtype) for _ in range(2))
    for mask in (torch.rand(batch, heads, slots) > 0.3, torch.rand(batch, 1, slots) > 0.3):
        mask[..., 0] = True
        exact = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask.unsqueeze(2))
        stale_keys, stale_values = keys.clone(), values.clone()
        hidden = ~mask.expand(batch, heads, slots)
        stale_keys[hidden], stale_values[hidden] = float("nan"), float("nan")
        y = torch.ops.kvwb.half_decode_attention(q, stale_keys, stale_values, mask)
        assert y.shape == q.shape and y.dtype == dtype
        weights = torch.softmax(
            (q.double() @ keys.double().transpose(-1, -2) / head_dim**0.5).masked_fill(~mask.unsqueeze(2), -torch.inf),
            dim=-1,
        )
        assert within_rounding(y, exact, weights @ values.double().abs(), slots)
        for b in range(batch):
            alone = torch.ops.kvwb.half_decode_attention(
                q[b : b + 1], stale_keys[b : b + 1], stale_values[b : b + 1], mask[b : b + 1]
            )
            assert torch.equal(alone, y[b : b + 1])
        more = 13  # a batch's cache has the slots of its longest sequence: masked ones after these
        padded_keys, padded_values = (F.pad(t, (0, 0, 0, more), value=float("nan")) for t in (stale_keys, stale_values))
        padded = torch.ops.kvwb.half_decode_attention(q, padded_keys, padded_values, F.pad(mask, (0, more)))
        assert torch.equal(padded, y)


@needs_half_kernels
def test_half_decode_attention_of_no_visible_slot_is_zero():
    q, keys = torch.randn(1, 2, 3, 16).bfloat16(), torch.randn(1, 2, 5, 16).bfloat16()
    y = torch.ops.kvwb.half_decode_attention(q, keys, keys, torch.zeros(1, 2, 5, dtype=torch.bool))
    assert torch.equal(y, torch.zeros_like(q))


@needs_half_kernels
def test_half_decode_attention_refuses_what_it_cannot_attend():
    q, keys = torch.randn(1, 2, 3, 16).bfloat16(), torch.randn(1, 2, 5, 16).bfloat16()
    mask = torch.ones(1, 2, 5, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.kvwb.half_decode_attention(q[..., :12], keys[..., :12], keys[..., :12], mask)
    with pytest.raises(RuntimeError, match="bool mask"):
        torch.ops.kvwb.half_decode_attention(q, keys, keys, mask.float())
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.kvwb.half_decode_attention(q.half(), keys, keys, mask)


def test_filled_slots_are_the_nonnegative_positions():
    """one_token.filled_slots (the kernel where it was built, for int32 positions): a cache's slot mask,
    also of a view such as a batch's row, and of positions of another dtype."""
    positions = torch.randint(-3, 600, (4, 3, 701), dtype=torch.int32)
    positions[0, 0, :5] = torch.tensor([-(2**31), -1, 0, 1, 2**31 - 1], dtype=torch.int32)
    for pos in (positions, positions[1:2, :, :650], positions.transpose(0, 1), positions.long()):
        filled = one_token.filled_slots(pos)
        assert filled.dtype == torch.bool and torch.equal(filled, pos >= 0)
    if HALF_KERNELS_MISSING is None:
        assert torch.equal(torch.ops.kvwb.filled_slots(positions), positions >= 0)
        with pytest.raises(RuntimeError, match="int32 positions"):
            torch.ops.kvwb.filled_slots(positions.long())


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 16), (torch.bfloat16, 12), (torch.float32, 16)])
def test_decode_attention_takes_the_kernel_only_for_emulated_half_precision(dtype, head_dim):
    """one_token.decode_attention: half_kernels.cpp where half precision is emulated and it was built
    and the head dim fills its lanes, else SDPA with the mask broadcast over the query heads."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, head_dim).to(dtype)
    keys, values = torch.randn(2, 2, 7, head_dim).to(dtype), torch.randn(2, 2, 7, head_dim).to(dtype)
    mask = torch.rand(2, 2, 7) > 0.3
    mask[..., 0] = True
    y = one_token.decode_attention(q, keys, values, mask)
    if one_token.matmul_dtype(q) != dtype and HALF_KERNELS_MISSING is None and head_dim % 8 == 0:
        assert torch.equal(y, torch.ops.kvwb.half_decode_attention(q, keys, values, mask))
    else:
        assert torch.equal(y, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(2)))


@needs_half_kernels
def test_a_bfloat16_model_decodes_through_both_kernels():
    """The model's decode steps call the kernels (a profile of the tiny model's generation), so a
    change in model.py that bypasses them fails here."""
    model = tiny_transformer(seed=0, dtype=torch.bfloat16)
    with torch.profiler.profile() as profile:
        generation.generate(model, tiny_prompt(80), 3, default_cache_kwargs())
    names = {event.name for event in profile.events()}
    assert {"kvwb::half_rows", "kvwb::half_decode_attention"} <= names
