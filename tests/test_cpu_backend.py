"""The CPU back-end: nothing built on import; its kernels (half_kernels.cpp, built on request) against
exact float64 references; its projections against plain torch's, eager and compiled."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import packed_copies, tiny_prompt, tiny_transformer

import cpu_backend
import generation
import model as model_module
from cache_args import default_cache_kwargs
from cpu_backend import HALF_MATMUL_IS_EMULATED, HALF_ROWS_MAX, ONEDNN_PACKS_BFLOAT16

HALF_DTYPES = [torch.bfloat16, torch.float16]
ROOT = Path(__file__).resolve().parent.parent
needs_packing = pytest.mark.skipif(
    not ONEDNN_PACKS_BFLOAT16, reason="oneDNN packs bfloat16 weights where the CPU has bf16 instructions"
)


@pytest.fixture(scope="module")
def kernels():
    """half_kernels.cpp built and loaded (the build is kept in build/ for later runs)."""
    from cpu_backend import build

    try:
        build.build()
    except RuntimeError as error:
        pytest.skip(f"half_kernels.cpp cannot be built here: {error}")
    assert cpu_backend.load_kernels() is None


def test_importing_and_help_build_nothing_without_a_compiler(tmp_path):
    """In a copy of the project, with no compiler on PATH: the entry points import and print their
    help without a warning, and no build/ folder appears."""
    copy = tmp_path / "project"
    ignore = shutil.ignore_patterns(".venv", ".git", "checkpoints", "build", "results", "__pycache__", "tests")
    shutil.copytree(ROOT, copy, ignore=ignore)
    env = {"PATH": str(tmp_path / "empty"), "HOME": str(tmp_path)}
    for args in (["-c", "import generate, eval, benchmark, strategies"], ["generate.py", "--help"]):
        proc = subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert not (copy / "build").exists()


def as_cpu_module(module: nn.Module) -> nn.Module:
    """The module with the back-end's classes swapped in (apply), requires_grad off."""
    return cpu_backend.apply(module.requires_grad_(False))


def within_rounding(y: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor, n_terms: int) -> bool:
    """|y - exact| within one rounding to y's dtype plus float32's error of a sum of `n_terms` terms
    whose magnitudes sum to `terms`."""
    rounding = torch.finfo(y.dtype).eps / 2 * exact.abs() + torch.finfo(torch.float32).eps * n_terms * terms
    return bool(((y.double() - exact).abs() <= rounding).all())


@pytest.mark.parametrize("dtype", HALF_DTYPES)
# 101: not a multiple of 8 or 16 lanes; 1541: on AVX2, more than 4 such rows do not fit L1 and take 3 x 4 tiles
@pytest.mark.parametrize(("n_in", "bias"), [(96, True), (101, False), (1541, True)])
def test_half_rows_sums_each_row_in_float32_and_rounds_once_alone_or_in_a_batch(dtype, n_in, bias, kernels):
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


def test_half_rows_refuses_mismatched_inputs(kernels):
    weight = torch.randn(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.kvwb.half_rows(torch.randn(2, 8).half(), weight, None)
    with pytest.raises(RuntimeError, match="weight \\[N, K\\]"):
        torch.ops.kvwb.half_rows(torch.randn(2, 7).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        torch.ops.kvwb.half_rows(torch.randn(2, 8), torch.randn(4, 8), None)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize(
    ("batch", "heads", "group", "slots", "head_dim"),
    [(3, 3, 3, 37, 64), (2, 2, 2, 50, 16), (1, 1, 4, 9, 128), (2, 2, 1, 3, 24)],  # dims of 8 to 128 lanes
)
def test_half_decode_attention_is_exact_attention_over_the_visible_slots(
    dtype, batch, heads, group, slots, head_dim, kernels
):
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


def test_half_decode_attention_of_no_visible_slot_is_zero(kernels):
    q, keys = torch.randn(1, 2, 3, 16).bfloat16(), torch.randn(1, 2, 5, 16).bfloat16()
    y = torch.ops.kvwb.half_decode_attention(q, keys, keys, torch.zeros(1, 2, 5, dtype=torch.bool))
    assert torch.equal(y, torch.zeros_like(q))


def test_half_decode_attention_refuses_what_it_cannot_attend(kernels):
    q, keys = torch.randn(1, 2, 3, 16).bfloat16(), torch.randn(1, 2, 5, 16).bfloat16()
    mask = torch.ones(1, 2, 5, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.kvwb.half_decode_attention(q[..., :12], keys[..., :12], keys[..., :12], mask)
    with pytest.raises(RuntimeError, match="bool mask"):
        torch.ops.kvwb.half_decode_attention(q, keys, keys, mask.float())
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.kvwb.half_decode_attention(q.half(), keys, keys, mask)


emulated_with_kernels = pytest.mark.skipif(
    not HALF_MATMUL_IS_EMULATED, reason="the kernels serve CPUs that emulate half precision"
)


@emulated_with_kernels
def test_a_bfloat16_model_decodes_through_both_kernels(kernels):
    """The back-end's decode steps call the kernels (a profile of the tiny model's generation), so a
    change that bypasses them fails here."""
    model = as_cpu_module(tiny_transformer(seed=0, dtype=torch.bfloat16))
    with torch.profiler.profile() as profile:
        generation.generate(model, tiny_prompt(80), 3, default_cache_kwargs())
    names = {event.name for event in profile.events()}
    assert {"kvwb::half_rows", "kvwb::half_decode_attention"} <= names


def test_one_bfloat16_token_projects_through_the_kernel_that_suits_the_cpu():
    """A decode step's token goes through the packed copy where oneDNN has bfloat16 instructions,
    half_kernels.cpp where half precision is emulated and it was built, else through torch.mv where it
    is emulated outside oneDNN, else F.linear: the same projection."""
    layer = as_cpu_module(nn.Linear(96, 40, bias=True).to(torch.bfloat16))
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (1, 1, 40) and y.dtype == torch.bfloat16
    if HALF_MATMUL_IS_EMULATED and cpu_backend.kernels_missing() is None:
        assert torch.equal(y.view(1, -1), torch.ops.kvwb.half_rows(x.view(1, -1), layer.weight, layer.bias))
    elif cpu_backend.BFLOAT16_TOKEN_TAKES_MV:
        assert torch.equal(y.view(-1), torch.mv(layer.weight, x.view(-1)) + layer.bias)
    else:
        assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(y.double(), exact, rtol=2e-2, atol=2e-2)


@needs_packing
@pytest.mark.parametrize(
    ("n_in", "n_out", "bias"),
    [(576, 960, True), (576, 576, False), (576, 1536, False), (1536, 576, False), (576, 49152, False)],
)
def test_one_token_projects_through_the_packed_weights_with_the_plain_weights_values(n_in, n_out, bias):
    """Packing changes the speed of a one-token projection, not its values (the embedded model's
    shapes); the plain weight is zeroed after packing to show which copy each path reads."""
    torch.manual_seed(0)
    layer = nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 1, n_in, dtype=torch.bfloat16)
    plain = layer(x)
    layer = as_cpu_module(layer)
    assert layer.packed_weight is not None
    layer.weight.zero_()
    assert torch.equal(layer(x), plain)
    from_plain = torch.zeros(n_out, dtype=torch.bfloat16) if layer.bias is None else layer.bias
    assert torch.equal(layer(torch.cat([x, x], dim=1)), from_plain.expand(1, 2, -1))  # 2 tokens: the plain weight
    layer.float()  # a cast (or move) drops the packed copy, which would no longer match the weight
    assert layer.packed_weight is None


@needs_packing
def test_weights_are_packed_only_when_the_copy_fits_in_a_quarter_of_free_memory(monkeypatch):
    model = tiny_transformer(seed=0, dtype=torch.bfloat16)
    weight_bytes = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear))
    monkeypatch.setattr(cpu_backend, "free_memory_bytes", lambda: 4 * weight_bytes - 1)
    cpu_backend.apply(model)
    assert not any(packed_copies(model))
    monkeypatch.setattr(cpu_backend, "free_memory_bytes", lambda: 4 * weight_bytes)
    cpu_backend.pack_one_token_weights(model)
    assert all(packed_copies(model))
    assert model.layers[0].feed_forward.w1.packed_weight is None  # w1 and w3 only in their stacked copy


@needs_packing
def test_one_token_feed_forward_through_the_stacked_packed_w1_w3_gives_the_separate_products_values():
    """One oneDNN call for w1 and w3 (the embedded model's shapes) gives each product's values bit for
    bit; w1 and w3 are zeroed after packing to show that one token reads the stacked copy."""
    torch.manual_seed(0)
    feed_forward = model_module.FeedForward(model_module.ModelArgs(dim=576, intermediate_size=1536))
    feed_forward = feed_forward.to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 1, 576, dtype=torch.bfloat16)
    separate = feed_forward(x)
    feed_forward = as_cpu_module(feed_forward)
    feed_forward.w1.weight.zero_()
    feed_forward.w3.weight.zero_()
    assert torch.equal(feed_forward(x), separate)
    assert torch.equal(feed_forward(torch.cat([x, x], dim=1)), torch.zeros(1, 2, 576, dtype=torch.bfloat16))
    feed_forward.float()  # a cast (or move) drops the stacked copy too
    assert feed_forward.packed_weight is None


@emulated_with_kernels
@pytest.mark.parametrize("bias", [True, False])
def test_decode_rows_project_through_half_rows_where_half_precision_is_emulated(bias, kernels):
    """The rows of a batch's decode step, and a prompt of up to HALF_ROWS_MAX tokens, multiply the
    plain half-precision weight in half_kernels.cpp."""
    torch.manual_seed(0)
    layer = as_cpu_module(nn.Linear(96, 40, bias=bias).to(torch.bfloat16))
    for shape in ((3, 1, 96), (1, HALF_ROWS_MAX, 96)):
        x = torch.randn(*shape, dtype=torch.bfloat16)
        kernel = torch.ops.kvwb.half_rows(x.view(-1, 96), layer.weight, layer.bias).view(*shape[:-1], 40)
        assert torch.equal(layer(x), kernel)


@pytest.mark.slow
def test_compiled_batch_feed_forward_rounds_as_eager():
    """Compiled, a batch's products (half_kernels.cpp where half precision is emulated and built: a
    custom op that inductor calls), their rounding to bfloat16 and the SiLU between them give eager's
    values bit for bit (the embedded model's shapes, 4 rows)."""
    torch.manual_seed(0)
    feed_forward = model_module.FeedForward(model_module.ModelArgs(dim=576, intermediate_size=1536))
    feed_forward = as_cpu_module(feed_forward.to(torch.bfloat16))
    step = lambda module, x: module(x)  # noqa: E731
    compiled = generation.compile_steps({"decode": step, "prefill": step}, torch.device("cpu"))["decode"]
    x = torch.randn(4, 1, 576, dtype=torch.bfloat16)
    with torch.no_grad():  # as generation runs: freezing takes the weights as constants
        assert torch.equal(compiled(feed_forward, x), step(feed_forward, x))
    torch._dynamo.reset()


@pytest.mark.slow
def test_without_the_half_kernels_compiled_one_token_projection_rounds_as_eager(monkeypatch):
    """Where half_kernels.cpp is not loaded, eager's one-token projection takes the kernel whose sums
    compiled F.linear repeats (the output layer's shape)."""
    monkeypatch.setattr(cpu_backend, "_kernels_missing", "not built")
    torch.manual_seed(0)
    layer = as_cpu_module(nn.Linear(576, 49152, bias=False).to(torch.bfloat16))
    step = lambda module, x: module(x)  # noqa: E731
    compiled = generation.compile_steps({"decode": step, "prefill": step}, torch.device("cpu"))["decode"]
    x = torch.randn(1, 1, 576, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(compiled(layer, x), step(layer, x))
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_prompt_projects_through_one_float32_gemm(dtype):
    """On a CPU without half-precision instructions, a many-token projection is the float32 product
    of the same values, rounded once: within the dtype's rounding of the exact product."""
    layer = as_cpu_module(nn.Linear(96, 40, bias=True).to(dtype))
    x = torch.randn(1, HALF_ROWS_MAX + 1, 96, dtype=dtype)
    y = layer(x)
    assert y.shape == (1, HALF_ROWS_MAX + 1, 40) and y.dtype == dtype
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(y.double(), exact, rtol=2e-2, atol=2e-2)
    upcast = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(dtype)
    if HALF_MATMUL_IS_EMULATED:
        assert torch.equal(y, upcast)


def test_the_back_end_leaves_float32_greedy_tokens_as_they_were():
    """The tiny model's greedy tokens, with and without the back-end, for a compressing strategy."""
    prompt, kwargs = tiny_prompt(60, seed=3), default_cache_kwargs(cache_strategy=["l2"], max_cache_length=[0.5])
    plain = generation.generate(tiny_transformer(seed=0), prompt, 12, kwargs)[0]
    swapped = generation.generate(as_cpu_module(tiny_transformer(seed=0)), prompt, 12, kwargs)[0]
    assert swapped.tolist() == plain.tolist()
