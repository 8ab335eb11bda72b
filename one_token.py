"""CPU kernels for model.Linear and model.FeedForward, picked by shape and dtype, and oneDNN-packed weights.

A decode step multiplies one token per sequence by every weight, so its speed is the speed at which
the kernel streams the weights. Where the CPU has bfloat16 instructions, oneDNN streams a copy of the
weights in its own blocked layout faster than the plain weights, with the same values: load_model
packs them (pack_one_token_weights) and one token of a decode step goes through the packed copy
(KeepsPackedCopy.packed_product). Where the CPU only emulates half precision, a decode step of a batch
(several rows) goes through a float32 packed copy instead (pack_batch_weights, made when a batch is
set up, and kept while the model lives): the emulated half-precision GEMM, or an upcast of every
weight at every step, costs more than streaming twice the bytes. Neither copy is made without oneDNN
or where it would take over a quarter of the available memory. Everything else goes through
`linear`, which works around CPUs that only emulate half precision. Each path rounds alike eager and
compiled, so compiled tokens stay eager's.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# CPUs whose best vector unit is AVX2 have no bfloat16 or float16 instructions: their half-precision
# products are emulated, far slower than the float32 products of the same values.
HALF_MATMUL_IS_EMULATED = torch.backends.cpu.get_cpu_capability() in ("AVX2", "NO AVX", "DEFAULT")
FLOAT32_GEMM_MIN_ROWS = 8  # with fewer rows the weights' upcast costs more than the float32 GEMM saves
# With bfloat16 instructions (AVX512-BF16, AMX), oneDNN multiplies one token by the weights it has packed
# faster than by the plain weights (F.linear), and to the same values at every projection shape.
ONEDNN_PACKS_BFLOAT16 = (
    not HALF_MATMUL_IS_EMULATED
    and torch.backends.mkldnn.is_available()
    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


def matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype to multiply x's values in: float32 for half precision on a CPU that only emulates it
    (the upcast is exact, and the float32 kernels are faster), else x's own."""
    if HALF_MATMUL_IS_EMULATED and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return x.dtype


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear on the kernel that suits x's shape and dtype.

    Many tokens in half precision on a CPU that emulates it (a prefill): the exact float32 upcast, a
    float32 GEMM and one rounding back. One token on CPU: eager bfloat16 runs torch.mv where bfloat16 is
    emulated (faster than F.linear's GEMM, same values); compiled float32 a multiply and row sum that
    inductor fuses into one pass over the weights. Compiled bfloat16 keeps F.linear, which inductor
    leaves to ATen's GEMM: for one row it sums in torch.mv's order, so compiled rounds as eager does
    (torch.mv itself inductor would decompose into a reduction that sums in another order).
    """
    rows = x.shape[:-1].numel()
    on_cpu = x.device.type == "cpu"
    compiling = torch.compiler.is_compiling()
    work = matmul_dtype(x)
    if work != x.dtype and rows >= FLOAT32_GEMM_MIN_ROWS:
        upcast_bias = None if bias is None else bias.to(work)
        return F.linear(x.to(work), weight.to(work), upcast_bias).to(x.dtype)
    if rows == 1 and on_cpu and compiling and x.dtype == torch.float32:
        y = (weight * x.reshape(1, -1)).sum(-1)
    elif rows == 1 and on_cpu and not compiling and x.dtype == torch.bfloat16 and HALF_MATMUL_IS_EMULATED:
        y = torch.mv(weight, x.reshape(-1))
    else:
        return F.linear(x, weight, bias)
    return (y if bias is None else y + bias).view(*x.shape[:-1], -1)


BATCH_ROWS_HINT = 8  # the rows oneDNN lays a batch copy out for; any number of rows multiplies by it


def pack_weight(weight: Tensor, rows: int) -> Tensor:
    """oneDNN's packed copy of a weight, laid out for products with `rows` rows, for packed_product_of.
    A compiled graph takes the packed tensor only as a frozen constant (compile_steps freezes the
    decode graph, not prefill's), and only with static sizes."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    torch._dynamo.mark_static(packed)
    return packed


def packed_product_of(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., n_in] times a weight packed by pack_weight, eager and compiled alike.

    The views keep inductor from fusing the next op (SiLU, the residual add) into the product, which
    would round once where eager rounds twice."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], -1)


class KeepsPackedCopy(nn.Module):
    """A module that may hold oneDNN-packed copies of its weights for decode steps: one for one-token
    products (`pack`), and a float32 one for batches where half precision is emulated (`pack_batch`).

    A copy holds the module's own weight, or the weights of the child projections named in `stacks`
    stacked: projections of the same input then cost one oneDNN call, and each output equals its own
    product's bit for bit.
    """

    packed_weight: Tensor | None = None
    batch_weight: Tensor | None = None
    stacks: tuple[str, ...] = ()

    def weights_to_pack(self) -> list[Tensor]:
        return [getattr(self, name).weight for name in self.stacks] or [self.weight]

    def stacked_weight(self) -> Tensor:
        weights = self.weights_to_pack()
        return torch.cat(weights) if len(weights) > 1 else weights[0]

    def pack(self) -> None:
        """Keeps the packed copy beside the plain weights (prefill and a tied embedding read those): one
        more copy of the weights in memory for a faster one-token product. Pack after the last change
        to the weights; the copies do not follow them."""
        self.packed_weight = pack_weight(self.stacked_weight(), 1)

    def pack_batch(self) -> None:
        """Keeps a float32 packed copy (the exact upcast) for decode steps of several rows."""
        self.batch_weight = pack_weight(self.stacked_weight().float(), BATCH_ROWS_HINT)

    def packed_product(self, x: Tensor, decode: bool, bias: Tensor | None = None) -> Tensor | None:
        """x times a packed copy for a decode step: one token through the one-token copy, several through
        the float32 batch copy, rounded once to x's dtype; None where the plain weights serve."""
        one_row = x.shape[:-1].numel() == 1
        packed = self.packed_weight if one_row else self.batch_weight
        if not decode or packed is None:
            return None
        if one_row:
            return packed_product_of(x, packed, bias)
        return packed_product_of(x.float(), packed, None if bias is None else bias.float()).to(x.dtype)

    def _apply(self, fn, recurse=True):
        self.packed_weight = self.batch_weight = None  # a move or cast would leave the copies behind
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


def pack_projections(model: nn.Module, dtypes: tuple[torch.dtype, ...], copy_element_size: int, pack) -> None:
    """Calls pack(module) on every projection of a CPU model whose weights are of `dtypes`, unless the
    copies (`copy_element_size` bytes a value) would take more than a quarter of the available memory:
    a faster decode is not worth swapping."""
    projections = one_token_projections(model)
    weights = [w for m in projections for w in m.weights_to_pack()]
    if any(w.device.type != "cpu" or w.dtype not in dtypes for w in weights):
        return
    if sum(w.numel() for w in weights) * copy_element_size * 4 > free_memory_bytes():
        return
    for module in projections:
        pack(module)


def pack_one_token_weights(model: nn.Module) -> None:
    """Packs the projections of a bfloat16 model on a CPU where oneDNN has bfloat16 instructions."""
    if ONEDNN_PACKS_BFLOAT16:
        pack_projections(model, (torch.bfloat16,), 2, KeepsPackedCopy.pack)


def pack_batch_weights(model: nn.Module) -> None:
    """Gives the projections of a half-precision model their float32 batch copies on a CPU that only
    emulates half precision (twice the model's bytes; once per model)."""
    if not HALF_MATMUL_IS_EMULATED or not torch.backends.mkldnn.is_available():
        return
    if any(m.batch_weight is None for m in one_token_projections(model)):
        pack_projections(model, (torch.bfloat16, torch.float16), 4, KeepsPackedCopy.pack_batch)
