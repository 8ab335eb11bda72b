"""The Llama-style Transformer (gpt-fast style) and the attention layer that talks to its KV cache."""

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from quantization_utils import QuantizedTensor, order_free_dtype, quantized_scores, quantized_weighted_sum


@dataclass
class ModelArgs:
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int = 11008
    n_local_heads: int = -1
    head_dim: int = -1
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    rope_scaling: dict = field(default_factory=dict)
    attention_bias: bool = False
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim == -1:
            self.head_dim = self.dim // self.n_head

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """Exact name first, then the longest config name contained in `name` (case-insensitive)."""
        if name in transformer_configs:
            return cls(**transformer_configs[name])
        matches = [n for n in transformer_configs if n.lower() in name.lower()]
        if not matches:
            raise ValueError(
                f"no model config matches '{name}'; known configs: {', '.join(transformer_configs)} "
                "(or put a config.json in the checkpoint folder)"
            )
        return cls(**transformer_configs[max(matches, key=len)])

    @classmethod
    def from_json(cls, path: Path) -> "ModelArgs":
        """Reads our own config.json, or an HF config.json (keys like hidden_size)."""
        config = json.loads(Path(path).read_text())
        if "hidden_size" in config:
            config = hf_config_to_args(config)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in known})

    @classmethod
    def from_checkpoint_dir(cls, checkpoint_dir: Path) -> "ModelArgs":
        config_path = Path(checkpoint_dir) / "config.json"
        if config_path.is_file():
            return cls.from_json(config_path)
        return cls.from_name(Path(checkpoint_dir).name)

    def to_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


def hf_config_to_args(config: dict) -> dict:
    """Maps an HF Llama/Qwen2 config.json onto ModelArgs fields."""
    n_head = config["num_attention_heads"]
    rope_scaling = config.get("rope_scaling") or {}
    rope_base = config.get("rope_theta", 10000.0)
    if "rope_parameters" in config:  # transformers >= 5 folds theta and scaling together
        params = dict(config["rope_parameters"])
        rope_base = params.pop("rope_theta", rope_base)
        rope_scaling = params
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"RoPE scaling '{rope_type}' is not supported (only llama3)")
    rope_scaling = {**rope_scaling, "rope_type": "llama3"} if rope_type == "llama3" else {}
    return dict(
        block_size=config.get("max_position_embeddings", 2048),
        vocab_size=config["vocab_size"],
        n_layer=config["num_hidden_layers"],
        n_head=n_head,
        dim=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        n_local_heads=config.get("num_key_value_heads", n_head),
        head_dim=config.get("head_dim") or config["hidden_size"] // n_head,
        rope_base=rope_base,
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_scaling=rope_scaling,
        attention_bias=config.get("attention_bias", config.get("model_type") == "qwen2"),
        tie_embeddings=config.get("tie_word_embeddings", False),
    )


LLAMA31_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

transformer_configs = {
    "SmolLM2-135M": dict(
        block_size=8192,
        vocab_size=49152,
        n_layer=30,
        n_head=9,
        n_local_heads=3,
        dim=576,
        intermediate_size=1536,
        rope_base=100000.0,
        tie_embeddings=True,
    ),
    "Llama-2-7b-chat": dict(block_size=4096, n_layer=32, n_head=32, dim=4096),
    "Meta-Llama-3-8B-Instruct": dict(
        block_size=8192,
        n_layer=32,
        n_head=32,
        n_local_heads=8,
        dim=4096,
        intermediate_size=14336,
        vocab_size=128256,
        rope_base=500000.0,
    ),
    "Meta-Llama-3.1-8B-Instruct": dict(
        block_size=131072,
        n_layer=32,
        n_head=32,
        n_local_heads=8,
        dim=4096,
        intermediate_size=14336,
        vocab_size=128256,
        rope_base=500000.0,
        rope_scaling=LLAMA31_SCALING,
    ),
    "Qwen2-0.5B-Instruct": dict(
        block_size=32768,
        n_layer=24,
        n_head=14,
        n_local_heads=2,
        dim=896,
        intermediate_size=4864,
        vocab_size=151936,
        rope_base=1000000.0,
        norm_eps=1e-6,
        attention_bias=True,
        tie_embeddings=True,
    ),
    "Qwen2-1.5B-Instruct": dict(
        block_size=32768,
        n_layer=28,
        n_head=12,
        n_local_heads=2,
        dim=1536,
        intermediate_size=8960,
        vocab_size=151936,
        rope_base=1000000.0,
        norm_eps=1e-6,
        attention_bias=True,
        tie_embeddings=True,
    ),
    "Qwen2-7B-Instruct": dict(
        block_size=32768,
        n_layer=28,
        n_head=28,
        n_local_heads=4,
        dim=3584,
        intermediate_size=18944,
        vocab_size=152064,
        rope_base=1000000.0,
        norm_eps=1e-6,
        attention_bias=True,
    ),
}


# CPUs whose best vector unit is AVX2 have no bfloat16 or float16 instructions: there a half-precision
# matrix product of 2,000 rows ran 10x slower than the float32 product of the same values.
HALF_MATMUL_IS_EMULATED = torch.backends.cpu.get_cpu_capability() in ("AVX2", "NO AVX", "DEFAULT")
FLOAT32_GEMM_MIN_ROWS = 8  # fewer rows: the weights' upcast costs more than it saves (measured at 4)
# With bfloat16 instructions (AVX512-BF16, AMX), oneDNN multiplies one token by weights it has packed
# into its blocked layout streaming them at 15-31 GB/s, by the plain weights (F.linear) at 10-13 GB/s
# (AVX512-BF16 VM); both gave the same values, bit for bit, at every projection shape of the embedded model.
ONEDNN_PACKS_BFLOAT16 = (
    not HALF_MATMUL_IS_EMULATED
    and torch.backends.mkldnn.is_available()
    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


def matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype to multiply x's values in: float32 for half precision on a CPU that only emulates it
    (the upcast is exact, and the float32 kernels ran 2-10x faster), else x's own."""
    if HALF_MATMUL_IS_EMULATED and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return x.dtype


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
    """A module that may hold a oneDNN-packed copy of its weights for one-token products (`pack`)."""

    packed_weight: Tensor | None = None

    def _apply(self, fn, recurse=True):
        self.packed_weight = None  # a move or cast would leave the packed copy behind
        return super()._apply(fn, recurse)


class Linear(KeepsPackedCopy, nn.Linear):
    """nn.Linear that picks, on CPU, the kernel that is fastest for the shape and dtype.

    One token of a decode step (`decode`): bfloat16 weights packed by `pack` go through oneDNN's product on
    the packed copy, eager and compiled alike (the same op, so the same rounding); else eager bfloat16 runs
    torch.mv where bfloat16 is emulated (full decode @512: 12-16% faster than F.linear's GEMM, same
    values), compiled float32 a multiply and row sum that inductor fuses into one pass over the weights
    (@512: +23%); compiled bfloat16 keeps F.linear, which inductor leaves to ATen's GEMM: for one row it
    sums in torch.mv's order, so compiled rounds as eager does (torch.mv itself inductor would decompose
    into a reduction that sums in another order). Many tokens in half precision on a CPU without
    half-precision instructions (a prefill): the exact float32 upcast, a float32 GEMM and one rounding
    back (bfloat16 prefill @2000: 5x faster).
    """

    def pack(self) -> None:
        """Keeps oneDNN's packed copy of the weight beside the plain one (prefill and a tied embedding
        read that): one more copy of the weights in memory for a 2-4x faster one-token product. Pack
        after the last change to the weight; the copy does not follow it."""
        self.packed_weight = pack_for_one_token(self.weight)

    def forward(self, x: Tensor, decode: bool = False) -> Tensor:
        rows = x.shape[:-1].numel()
        if decode and rows == 1 and self.packed_weight is not None:
            return one_token_product(x, self.packed_weight, self.bias)
        on_cpu = x.device.type == "cpu"
        compiling = torch.compiler.is_compiling()
        work = matmul_dtype(x)
        if work != x.dtype and rows >= FLOAT32_GEMM_MIN_ROWS:
            bias = None if self.bias is None else self.bias.to(work)
            return F.linear(x.to(work), self.weight.to(work), bias).to(x.dtype)
        if rows == 1 and on_cpu and compiling and x.dtype == torch.float32:
            y = (self.weight * x.reshape(1, -1)).sum(-1)
        elif rows == 1 and on_cpu and not compiling and x.dtype == torch.bfloat16 and HALF_MATMUL_IS_EMULATED:
            y = torch.mv(self.weight, x.reshape(-1))
        else:
            return super().forward(x)
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], -1)


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
    """The modules pack_one_token_weights packs: each FeedForward (w1 and w3 stacked), every other Linear."""
    feed_forwards = [m for m in model.modules() if isinstance(m, FeedForward)]
    joined = {id(p) for f in feed_forwards for p in (f.w1, f.w3)}
    return feed_forwards + [m for m in model.modules() if isinstance(m, Linear) and id(m) not in joined]


def pack_one_token_weights(model: nn.Module) -> None:
    """Packs the projections of a bfloat16 model on a CPU where oneDNN has bfloat16 instructions (see
    Linear.pack), unless the packed copies would take more than a quarter of the available memory: a
    speed-up is not worth swapping (an 8B model in bfloat16 would need 16 GB more)."""
    weights = [m.weight for m in model.modules() if isinstance(m, Linear)]
    if not ONEDNN_PACKS_BFLOAT16 or any(w.device.type != "cpu" or w.dtype != torch.bfloat16 for w in weights):
        return
    if sum(w.numel() * w.element_size() for w in weights) * 4 > free_memory_bytes():
        return
    for module in one_token_projections(model):
        module.pack()


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.freqs_cis: Tensor | None = None

    def setup_caches(self, caches: list[nn.Module], max_seq_length: int) -> None:
        """Installs one KV cache per layer (built by cache.create_caches) and the RoPE table."""
        if len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} caches for {len(self.layers)} layers")
        for layer, cache in zip(self.layers, caches):
            layer.attention.kv_cache = cache
        device = self.output.weight.device
        self.freqs_cis = precompute_freqs_cis(
            max_seq_length, self.config.head_dim, self.config.rope_base, self.config.rope_scaling
        ).to(device)

    def forward(self, idx: Tensor, input_pos: Tensor, is_prefill: bool = False, last_only: bool = False) -> Tensor:
        """idx [B, T] at positions input_pos [T]; returns logits [B, T, vocab] in float32.

        `last_only` projects only the last position: prefill needs no more, and the T x vocab
        logits would dominate its memory.
        """
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, is_prefill, idx)
        if last_only:
            x = x[:, -1:]
        return self.output(self.norm(x), decode=not is_prefill).float()

    @classmethod
    def from_name(cls, name: str) -> "Transformer":
        return cls(ModelArgs.from_name(name))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, is_prefill: bool, token_ids: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, input_pos, is_prefill, token_ids)
        return h + self.feed_forward(self.ffn_norm(h), decode=not is_prefill)


class Attention(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_local_heads = config.n_local_heads
        self.head_dim = config.head_dim
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = Linear(config.dim, total_head_dim, bias=config.attention_bias)
        self.wo = Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.kv_cache: nn.Module | None = None

    def forward(
        self, x: Tensor, freqs_cis: Tensor, input_pos: Tensor, is_prefill: bool, token_ids: Tensor | None = None
    ) -> Tensor:
        """token_ids [B, T] reach the cache for strategies that keep special or punctuation tokens."""
        bsz, seqlen, _ = x.shape
        q_size = self.n_head * self.head_dim
        kv_size = self.n_local_heads * self.head_dim
        qk, v = self.wqkv(x, decode=not is_prefill).split([q_size + kv_size, kv_size], dim=-1)
        # One rotation for the query and key heads together: half the ops of an eager decode step's RoPE.
        qk = apply_rotary_emb(qk.view(bsz, seqlen, self.n_head + self.n_local_heads, self.head_dim), freqs_cis)
        q, k = qk.transpose(1, 2).split([self.n_head, self.n_local_heads], dim=1)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        if is_prefill:
            y = self.prefill_attention(q, k, v, input_pos, token_ids)
        else:
            y = self.decode_attention(q, k, v, input_pos, token_ids)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, q_size), decode=not is_prefill)

    def prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, token_ids: Tensor) -> Tensor:
        """Full causal attention over the prompt; the cache then takes what its compressor keeps."""
        if self.kv_cache is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.kv_cache.attend_prompt(input_pos, q, k, v, token_ids)

    def decode_attention(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, token_ids: Tensor) -> Tensor:
        """One query per KV-head group attends over the cache slots.

        Viewing the G query heads that share a KV head as G queries of that head lets a per-head
        slot mask broadcast without repeating keys.
        """
        bsz, _, seqlen, _ = q.shape
        group = self.n_head // self.n_local_heads
        keys, values, mask = self.kv_cache.update_kv(input_pos, k, v, query=q, token_ids=token_ids)
        q = q.view(bsz, self.n_local_heads, group * seqlen, self.head_dim)
        mask = mask.unsqueeze(2)
        if self.kv_cache.return_attn():
            y, attn = attention_with_probs(q, keys, values, mask)
            attn = attn.view(bsz, self.n_local_heads, group, seqlen, -1)
            self.kv_cache.update_state(input_pos, k, v, is_prefill=False, attn=attn)
        elif isinstance(keys, QuantizedTensor):
            y, _ = attention_with_probs(q, keys, values, mask)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return y.view(bsz, self.n_head, seqlen, self.head_dim)


@torch.library.custom_op("kvwb::softmax", mutates_args=())
def opaque_softmax(x: Tensor) -> Tensor:
    return torch.softmax(x, dim=-1)


@opaque_softmax.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def softmax_as_eager(x: Tensor) -> Tensor:
    """Softmax over the last dim that rounds alike eager and compiled: compiled, eager's kernel behind
    a custom op, since inductor's fused softmax sums in another order (29% of the probabilities of a
    4,096-slot case differed in the last bits) and caches that weight or score by them then gave
    compiled greedy tokens unlike eager's; eager, torch.softmax itself (the op's dispatch costs 14 us)."""
    return opaque_softmax(x) if torch.compiler.is_compiling() else torch.softmax(x, dim=-1)


def attention_with_probs(q: Tensor, k, v, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Attention that also returns the probabilities, for caches that score tokens by attention.

    Half-precision scores and sums are float32, as SDPA accumulates: with bfloat16 scores (CPUs with
    bfloat16 instructions) heavy_hitter at full length gave other greedy tokens than the full cache.
    k and v may be a low-bit cache's QuantizedTensor: the dequantization folds into the two matmuls.
    """
    if isinstance(k, QuantizedTensor):
        scores = quantized_scores(q, k)
    else:
        scores = q.float() @ k.float().transpose(-1, -2)
    probs = softmax_as_eager(torch.where(mask, scores * (1.0 / math.sqrt(q.shape[-1])), float("-inf")))
    if isinstance(v, QuantizedTensor):
        return quantized_weighted_sum(probs, v).to(q.dtype), probs
    return (probs @ v.float()).to(v.dtype), probs


class FeedForward(KeepsPackedCopy):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.w1 = Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = Linear(config.intermediate_size, config.dim, bias=False)

    def pack(self) -> None:
        """One packed copy of w1 and w3 stacked (they multiply the same input): a decode step then
        makes one oneDNN call for both, 30 fewer per step for the embedded model (-1 ms @512, 5%), and
        each output equals its own product's bit for bit. w2 packs as a Linear."""
        self.packed_weight = pack_for_one_token(torch.cat([self.w1.weight, self.w3.weight]))

    def forward(self, x: Tensor, decode: bool = False) -> Tensor:
        if decode and x.shape[:-1].numel() == 1 and self.packed_weight is not None:
            gate, up = one_token_product(x, self.packed_weight, None).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x, decode), self.w3(x, decode)
        return self.w2(F.silu(gate) * up, decode)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """The mean square accumulates in float64 (MPS has none: float32), so eager's and a fused
        kernel's summation orders round to the same float32 scale: the compiled bfloat16 prefill of
        4,096 tokens is then bit-identical to eager's (with float32 sums, ~1 in 200,000 normalized
        values differed)."""
        xf = x.float()
        scale = torch.rsqrt(xf.to(order_free_dtype(x.device)).pow(2).mean(-1, keepdim=True) + self.eps).float()
        return (xf * scale).type_as(x) * self.weight


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


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float, rope_scaling: dict | None = None) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: n_elem // 2] / n_elem))
    if rope_scaling and rope_scaling.get("rope_type", "llama3") == "llama3":
        freqs = apply_rope_scaling(freqs, rope_scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).float()


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotates pairs (x[i], x[i + d/2]) -- the HF layout, so HF weights load without permutation."""
    half = x.shape[-1] // 2
    cos = freqs_cis[..., 0].view(1, x.size(1), 1, half)
    sin = freqs_cis[..., 1].view(1, x.size(1), 1, half)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)
