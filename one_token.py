"""CPU kernels for model.Linear, model.FeedForward and decode attention, picked by shape and dtype, and
oneDNN-packed weights.

A decode step multiplies one token per sequence by every weight, so its speed is the speed at which
the kernel streams the weights. Where the CPU has bfloat16 instructions, oneDNN streams a copy of the
weights in its own blocked layout faster than the plain weights, with the same values: load_model
packs them (pack_one_token_weights) and one token of a decode step goes through the packed copy
(KeepsPackedCopy.packed_product). Where the CPU has AVX2 or AVX512 but only emulates half precision,
the few rows of a decode step (one per sequence) and its attention go through half_kernels.cpp, which
reads each half-precision weight once for all rows and widens weights and cache slots to float32 in
registers; it is built here, once, with torch's C++ extension builder. Everything else goes through
`linear`, which works around CPUs that only emulate half precision. Each path rounds alike eager and
compiled, so compiled tokens stay eager's.
"""

import os
import shlex
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

CPU_CAPABILITY = torch.backends.cpu.get_cpu_capability()
# CPUs whose best vector unit is AVX2, or AVX512 without its bfloat16 extension, have no bfloat16 or
# float16 products: they are emulated, far slower than the float32 products of the same values.
HALF_MATMUL_IS_EMULATED = CPU_CAPABILITY in ("AVX2", "NO AVX", "DEFAULT") or (
    CPU_CAPABILITY == "AVX512" and not torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()
)
FLOAT32_GEMM_MIN_ROWS = 8  # with fewer rows the weights' upcast costs more than the float32 GEMM saves
HALF_ROWS_MAX = 64  # with more rows the float32 GEMM of upcast weights is faster than half_kernels.cpp
# F.linear of bfloat16 values goes to oneDNN where it takes them (AVX512 and up, emulated without
# AVX512-BF16), else to ATen's own GEMM.
ONEDNN_BFLOAT16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
# With bfloat16 instructions (AVX512-BF16, AMX), oneDNN multiplies one token by the weights it has packed
# faster than by the plain weights (F.linear), and to the same values at every projection shape.
ONEDNN_PACKS_BFLOAT16 = not HALF_MATMUL_IS_EMULATED and ONEDNN_BFLOAT16
# Where half precision is emulated outside oneDNN, torch.mv multiplies one bfloat16 token faster than
# F.linear (ATen's GEMM), to the same values.
BFLOAT16_TOKEN_TAKES_MV = HALF_MATMUL_IS_EMULATED and not ONEDNN_BFLOAT16


# The vector units half_kernels.cpp is built for, by CPU capability: AVX512 multiplies in 16 lanes.
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
HALF_KERNELS_FLAGS = {"AVX2": AVX2_FLAGS, "AVX512": [*AVX2_FLAGS, "-mavx512f"]}
# One build per checkout, torch version and capability (torch's default folder is shared by every checkout).
HALF_KERNELS_BUILD = (
    Path(__file__).resolve().parent / "build" / f"half_kernels-torch{torch.__version__}-{CPU_CAPABILITY.lower()}"
)


def build_half_kernels() -> None:
    """cpp_extension.load of half_kernels.cpp: builds it where the cached build is missing or stale.

    torch guards a build with a lock file that a builder killed mid-build (a timed-out sweep job)
    leaves behind, and then every later import waits on it forever; a flock, which the kernel
    releases with its holder, lets one builder at a time through and clears such a leftover."""
    import fcntl

    from torch.utils import cpp_extension

    HALF_KERNELS_BUILD.mkdir(parents=True, exist_ok=True)
    with open(HALF_KERNELS_BUILD / "builder.flock", "w") as builder:
        fcntl.flock(builder, fcntl.LOCK_EX)
        (HALF_KERNELS_BUILD / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            "kvwb_half_kernels",
            [str(Path(__file__).with_name("half_kernels.cpp"))],
            extra_cflags=["-O3", *HALF_KERNELS_FLAGS[CPU_CAPABILITY], "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(HALF_KERNELS_BUILD),
            is_python_module=False,
        )


def half_kernels_build_failure() -> str | None:
    """Why half_kernels.cpp could not be built here, or None once it is built."""
    from torch.utils import cpp_extension

    compiler = (shlex.split(os.environ.get("CXX", "")) or ["c++"])[0]
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed"
    try:
        build_half_kernels()
    except Exception as error:  # a failed build: the slower kernels still work
        return (str(error).strip() or type(error).__name__).splitlines()[0].split(": [")[0][:200]
    return None


def load_half_kernels() -> str | None:
    """Builds half_kernels.cpp (only the first import compiles) and registers torch.ops.kvwb.half_rows
    and half_decode_attention; returns why they are not there instead."""
    if CPU_CAPABILITY not in HALF_KERNELS_FLAGS:
        return f"the kernels need AVX2 or AVX512, this CPU has {CPU_CAPABILITY}"
    # ninja from the requirements sits beside this Python, on PATH only where its environment is active;
    # the process gets its own PATH back after the build
    saved_path = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), saved_path or ""])
    try:
        reason = half_kernels_build_failure()
    finally:
        if saved_path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = saved_path
    if reason is not None:
        print(f"warning: half_kernels.cpp was not built ({reason}); half-precision decode takes slower kernels; "
              "a C++ compiler (g++) and ninja build it", file=sys.stderr)  # fmt: skip
        return reason
    torch.library.register_fake("kvwb::half_rows")(lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0]))
    torch.library.register_fake("kvwb::half_decode_attention")(lambda q, keys, values, mask: q.new_empty(q.shape))
    torch.library.register_fake("kvwb::filled_slots")(
        lambda positions: positions.new_empty(positions.shape, dtype=torch.bool)
    )
    return None


HALF_KERNELS_MISSING = load_half_kernels() if HALF_MATMUL_IS_EMULATED else "half precision has its own instructions"


def matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype to multiply x's values in: float32 for half precision on a CPU that only emulates it
    (the upcast is exact, and the float32 kernels are faster), else x's own."""
    if HALF_MATMUL_IS_EMULATED and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return x.dtype


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear on the kernel that suits x's shape and dtype.

    Half precision on a CPU that emulates it: up to HALF_ROWS_MAX rows (a decode step, a short
    prompt) through half_kernels.cpp where it was built; more (a prefill) through the exact float32
    upcast, a float32 GEMM and one rounding back. Without the kernel, one token in eager bfloat16 runs
    torch.mv where F.linear would take ATen's GEMM (faster, same values; oneDNN's sums differ). One
    token in compiled float32: a multiply and row sum that inductor fuses into one pass over the
    weights. Compiled half precision otherwise keeps F.linear, which inductor leaves to ATen's GEMM:
    for one row it sums in torch.mv's order, so compiled rounds as eager does (torch.mv itself inductor
    would decompose into a reduction that sums in another order).
    """
    rows = x.shape[:-1].numel()
    on_cpu = x.device.type == "cpu"
    compiling = torch.compiler.is_compiling()
    work = matmul_dtype(x)
    if work != x.dtype and HALF_KERNELS_MISSING is None and 0 < rows <= HALF_ROWS_MAX:
        return torch.ops.kvwb.half_rows(x.reshape(rows, -1), weight, bias).view(*x.shape[:-1], -1)
    if work != x.dtype and rows >= FLOAT32_GEMM_MIN_ROWS:
        upcast_bias = None if bias is None else bias.to(work)
        return F.linear(x.to(work), weight.to(work), upcast_bias).to(x.dtype)
    if rows == 1 and on_cpu and compiling and x.dtype == torch.float32:
        y = (weight * x.reshape(1, -1)).sum(-1)
    elif rows == 1 and on_cpu and not compiling and x.dtype == torch.bfloat16 and BFLOAT16_TOKEN_TAKES_MV:
        y = torch.mv(weight, x.reshape(-1))
    else:
        return F.linear(x, weight, bias)
    return (y if bias is None else y + bias).view(*x.shape[:-1], -1)


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Softmax attention of q [B, H, G, D] (one token's G query heads per KV head) over keys and values
    [B, H, S, D] at the slots where mask [B, H, S] is true: half_kernels.cpp where half precision is
    emulated (SDPA's CPU kernel emulates it too, and turns the mask into a float one when compiled),
    else SDPA."""
    if matmul_dtype(q) != q.dtype and HALF_KERNELS_MISSING is None and q.shape[-1] % 8 == 0:
        return torch.ops.kvwb.half_decode_attention(q, keys, values, mask)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(2))


def filled_slots(positions: Tensor) -> Tensor:
    """positions >= 0: the slots of a cache that hold a token. Through half_kernels.cpp where it was
    built and the positions are int32 on the CPU, for compiled decode (see there)."""
    if HALF_KERNELS_MISSING is None and positions.device.type == "cpu" and positions.dtype == torch.int32:
        return torch.ops.kvwb.filled_slots(positions)
    return positions >= 0


def pack_for_one_token(weight: Tensor) -> Tensor:
    """oneDNN's packed copy of a bfloat16 weight, for one_token_product. A compiled graph takes the
    packed tensor only as a frozen constant (compile_steps freezes the decode graph, not prefill's),
    and only with static sizes."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    torch._dynamo.mark_static(packed)
    return packed


def one_token_product(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., n_in] of one token times a weight packed by pack_for_one_token, eager and compiled alike.

    The views keep inductor from fusing the next op (SiLU, the residual add) into the product, which
    would round once where eager rounds twice."""
    y = torch.ops.mkldnn._linear_pointwise(x.view(1, -1), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], -1)


class KeepsPackedCopy(nn.Module):
    """A module that may hold a oneDNN-packed copy of its weights for one-token products (`pack`).

    The copy holds the module's own weight, or the weights of the child projections named in `stacks`
    stacked: projections of the same input then cost one oneDNN call, and each output equals its own
    product's bit for bit.
    """

    packed_weight: Tensor | None = None
    stacks: tuple[str, ...] = ()

    def weights_to_pack(self) -> list[Tensor]:
        return [getattr(self, name).weight for name in self.stacks] or [self.weight]

    def pack(self) -> None:
        """Keeps the packed copy beside the plain weights (prefill and a tied embedding read those): one
        more copy of the weights in memory for a faster one-token product. Pack after the last change
        to the weights; the copy does not follow them."""
        weights = self.weights_to_pack()
        self.packed_weight = pack_for_one_token(torch.cat(weights) if len(weights) > 1 else weights[0])

    def packed_product(self, x: Tensor, decode: bool, bias: Tensor | None = None) -> Tensor | None:
        """x times the packed copy for one token of a decode step; None where the plain weights serve."""
        if decode and x.shape[:-1].numel() == 1 and self.packed_weight is not None:
            return one_token_product(x, self.packed_weight, bias)
        return None

    def _apply(self, fn, recurse=True):
        self.packed_weight = None  # a move or cast would leave the packed copy behind
        return super()._apply(fn, recurse)


def free_memory_bytes() -> int:
    """MemAvailable on Linux; 0 where it cannot be read, so that nothing is packed there."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def one_token_projections(model: nn.Module) -> list[KeepsPackedCopy]:
    """The modules pack_one_token_weights packs: those that stack child projections, then every other
    one whose weights no stacked copy holds."""
    holders = [m for m in model.modules() if isinstance(m, KeepsPackedCopy)]
    stacked = {id(getattr(m, name)) for m in holders for name in m.stacks}
    return [m for m in holders if m.stacks] + [m for m in holders if not m.stacks and id(m) not in stacked]


def pack_one_token_weights(model: nn.Module) -> None:
    """Packs the projections of a bfloat16 model on a CPU where oneDNN has bfloat16 instructions,
    unless the packed copies would take more than a quarter of the available memory: a faster decode
    is not worth swapping."""
    projections = one_token_projections(model)
    weights = [w for m in projections for w in m.weights_to_pack()]
    if not ONEDNN_PACKS_BFLOAT16 or any(w.device.type != "cpu" or w.dtype != torch.bfloat16 for w in weights):
        return
    if sum(w.numel() * w.element_size() for w in weights) * 4 > free_memory_bytes():
        return
    for module in projections:
        module.pack()
