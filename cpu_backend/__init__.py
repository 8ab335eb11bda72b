"""The CPU back-end: faster CPU kernels swapped into a loaded model, with the same values.

`apply(model)` changes the class of the model's projections, feed-forwards and attention layers to
the subclasses below (their weights, hooks and caches stay), so model.py stays plain torch:

* Where the CPU has bfloat16 instructions (AVX512-BF16, AMX), oneDNN multiplies one token by a copy
  of the weights packed in its own blocked layout faster than by the plain weights (F.linear), to the
  same values: a decode step's one-token products go through packed copies.
* Where the CPU has AVX2 or AVX512 but only emulates half precision, half-precision products take the
  exact float32 upcast, and the few rows of a decode step (one per sequence) and its attention go
  through half_kernels.cpp where it was built (`make cpu-kernels`): it reads each half-precision weight
  once for all rows and widens weights and cache slots to float32 in registers.

Nothing is built on import: `build.py` builds the kernels on request, and `apply` loads them only if
they were built. Each path rounds alike eager and compiled, so compiled tokens stay eager's.
"""

import hashlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import Attention, FeedForward

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
# With bfloat16 instructions oneDNN multiplies one token by the weights it has packed faster than by
# the plain weights, and to the same values at every projection shape.
ONEDNN_PACKS_BFLOAT16 = not HALF_MATMUL_IS_EMULATED and ONEDNN_BFLOAT16
# Where half precision is emulated outside oneDNN, torch.mv multiplies one bfloat16 token faster than
# F.linear (ATen's GEMM), to the same values.
BFLOAT16_TOKEN_TAKES_MV = HALF_MATMUL_IS_EMULATED and not ONEDNN_BFLOAT16

# The vector units half_kernels.cpp is built for, by CPU capability: AVX512 multiplies in 16 lanes.
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
HALF_KERNELS_FLAGS = {"AVX2": AVX2_FLAGS, "AVX512": [*AVX2_FLAGS, "-mavx512f"]}
HALF_KERNELS_SOURCE = Path(__file__).with_name("half_kernels.cpp")
LIBRARY_NAME = "kvwb_half_kernels"


def kernels_build_dir() -> Path:
    """One build per source, torch version and CPU capability, in the checkout's build/ folder: a
    build of an older source is never loaded."""
    source = hashlib.sha256(HALF_KERNELS_SOURCE.read_bytes()).hexdigest()[:12]
    name = f"half_kernels-{source}-torch{torch.__version__}-{CPU_CAPABILITY.lower()}"
    return Path(__file__).resolve().parent.parent / "build" / name


_kernels_missing: str | None = "not loaded yet"


def load_kernels() -> str | None:
    """Registers torch.ops.kvwb.half_rows and half_decode_attention from the built library; returns
    why they are not there instead (never builds)."""
    global _kernels_missing
    if _kernels_missing is None:
        return None
    library = kernels_build_dir() / f"{LIBRARY_NAME}.so"
    if CPU_CAPABILITY not in HALF_KERNELS_FLAGS:
        return f"the kernels need AVX2 or AVX512, this CPU has {CPU_CAPABILITY}"
    if not library.is_file():
        return "not built (make cpu-kernels builds them)"
    torch.ops.load_library(str(library))
    torch.library.register_fake("kvwb::half_rows")(lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0]))
    torch.library.register_fake("kvwb::half_decode_attention")(lambda q, keys, values, mask: q.new_empty(q.shape))
    _kernels_missing = None
    return None


def kernels_missing() -> str | None:
    """Why half_kernels.cpp is not in use (None: loaded)."""
    return load_kernels()


def matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype to multiply x's values in: float32 for half precision on a CPU that only emulates it
    (the upcast is exact, and the float32 kernels are faster), else x's own."""
    if HALF_MATMUL_IS_EMULATED and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return x.dtype


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear on the kernel that suits x's shape and dtype.

    Half precision on a CPU that emulates it: up to HALF_ROWS_MAX rows (a decode step, a short
    prompt) through half_kernels.cpp where it was loaded; more (a prefill) through the exact float32
    upcast, a float32 GEMM and one rounding back. Without the kernel, one token in eager bfloat16 runs
    torch.mv where F.linear would take ATen's GEMM (faster, same values; oneDNN's sums differ). One
    token in compiled float32: a multiply and row sum that inductor fuses into one pass over the
    weights. Compiled half precision otherwise keeps F.linear, which inductor leaves to ATen's GEMM:
    for one row it sums in torch.mv's order, so compiled rounds as eager does (torch.mv itself inductor
    would decompose into a reduction that sums in another order).
    """
    rows = x.shape[:-1].numel()
    compiling = torch.compiler.is_compiling()
    work = matmul_dtype(x)
    if work != x.dtype and _kernels_missing is None and 0 < rows <= HALF_ROWS_MAX:
        return torch.ops.kvwb.half_rows(x.reshape(rows, -1), weight, bias).view(*x.shape[:-1], -1)
    if work != x.dtype and rows >= FLOAT32_GEMM_MIN_ROWS:
        upcast_bias = None if bias is None else bias.to(work)
        return F.linear(x.to(work), weight.to(work), upcast_bias).to(x.dtype)
    if rows == 1 and compiling and x.dtype == torch.float32:
        y = (weight * x.reshape(1, -1)).sum(-1)
    elif rows == 1 and not compiling and x.dtype == torch.bfloat16 and BFLOAT16_TOKEN_TAKES_MV:
        y = torch.mv(weight, x.reshape(-1))
    else:
        return F.linear(x, weight, bias)
    return (y if bias is None else y + bias).view(*x.shape[:-1], -1)


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

    def packed_product(self, x: Tensor, bias: Tensor | None = None) -> Tensor | None:
        """x times the packed copy for one token; None where the plain weights serve: also in a
        compiled graph that does not freeze the weights (prefill's), which cannot take the copy."""
        if self.packed_weight is None or x.shape[:-1].numel() != 1:
            return None
        if torch.compiler.is_compiling() and not torch._inductor.config.freezing:
            return None
        return one_token_product(x, self.packed_weight, bias)

    def _apply(self, fn, recurse=True):
        self.packed_weight = None  # a move or cast would leave the packed copy behind
        return super()._apply(fn, recurse)


class CPULinear(KeepsPackedCopy, nn.Linear):
    """nn.Linear through `linear`, or for one token through its packed copy where one was made."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.packed_product(x, self.bias)
        return linear(x, self.weight, self.bias) if y is None else y


class CPUFeedForward(KeepsPackedCopy, FeedForward):
    stacks = ("w1", "w3")  # one packed copy for both, as they multiply the same input

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.packed_product(x)
        gate, up = (self.w1(x), self.w3(x)) if gate_up is None else gate_up.chunk(2, dim=-1)
        return self.w2(self.activation(gate) * up)


class CPUAttention(Attention):
    """Decode attention through half_kernels.cpp, for half precision on a CPU that emulates it
    (SDPA's CPU kernel emulates it too, and turns the mask into a float one when compiled)."""

    def attend_slots(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        if q.shape[-1] % 8 == 0:
            return torch.ops.kvwb.half_decode_attention(q, keys, values, mask)
        return super().attend_slots(q, keys, values, mask)


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


def apply(model: nn.Module) -> nn.Module:
    """Swaps the CPU kernels into a model whose weights are on the CPU, after its last change of
    device, dtype or weights; a model elsewhere is returned as it is."""
    if next(model.parameters()).device.type != "cpu":
        return model
    half = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    swaps = {nn.Linear: CPULinear, FeedForward: CPUFeedForward}
    if half and HALF_MATMUL_IS_EMULATED and load_kernels() is None:
        swaps[Attention] = CPUAttention
    for module in model.modules():
        if type(module) in swaps:
            module.__class__ = swaps[type(module)]
    pack_one_token_weights(model)
    return model
