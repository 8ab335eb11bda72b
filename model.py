"""The Llama-style Transformer (gpt-fast style) and the attention layer that talks to its KV cache."""

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from one_token import KeepsPackedCopy, decode_attention, linear
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
        device = self.output.weight.device
        frequencies = rope_frequencies(self.config.head_dim, self.config.rope_base, self.config.rope_scaling)
        for layer, cache in zip(self.layers, caches):
            layer.attention.kv_cache = cache
            if cache is not None:
                cache.set_rope_frequencies(frequencies.float().to(device))
        self.freqs_cis = precompute_freqs_cis(
            max_seq_length, self.config.head_dim, self.config.rope_base, self.config.rope_scaling
        ).to(device)

    def forward(
        self, idx: Tensor, input_pos: Tensor, is_prefill: bool = False, last_only: bool = False, extends: bool = False
    ) -> Tensor:
        """idx [B, T] at positions input_pos [T], or one token per sequence at its own position
        (input_pos [B, 1], decode of a batch); returns logits [B, T, vocab] in float32.

        `last_only` projects only the last position: prefill needs no more, and the T x vocab
        logits would dominate its memory. `extends`: a prefill that continues what the caches hold
        (a later chunk of the prompt) instead of starting them.
        """
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, is_prefill, idx, extends)
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

    def forward(
        self,
        x: Tensor,
        input_pos: Tensor,
        freqs_cis: Tensor,
        is_prefill: bool,
        token_ids: Tensor,
        extends: bool = False,
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, input_pos, is_prefill, token_ids, extends)
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
        self,
        x: Tensor,
        freqs_cis: Tensor,
        input_pos: Tensor,
        is_prefill: bool,
        token_ids: Tensor | None = None,
        extends: bool = False,
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
        if is_prefill and extends:
            y = self.kv_cache.attend_chunk(input_pos, q, k, v, token_ids)
        elif is_prefill:
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
        if isinstance(keys, QuantizedTensor):
            y, attn = attention_with_probs(q, keys, values, mask.unsqueeze(2))
        else:
            # the full cache's kernel, whether or not the strategy also wants the probabilities: at full
            # length every strategy then decodes the full cache's tokens
            y = decode_attention(q, keys, values, mask)
            attn = attention_probs(q, keys, mask.unsqueeze(2)) if self.kv_cache.return_attn() else None
        if self.kv_cache.return_attn():
            attn = attn.view(bsz, self.n_local_heads, group, seqlen, -1)
            self.kv_cache.update_state(input_pos, k, v, is_prefill=False, attn=attn)
        return y.view(bsz, self.n_head, seqlen, self.head_dim)


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


class Linear(KeepsPackedCopy, nn.Linear):
    """nn.Linear on the CPU kernel that suits the shape and dtype (one_token.linear); one token of a
    decode step (`decode`) goes through load_model's packed copy of the weight where one was made."""

    def forward(self, x: Tensor, decode: bool = False) -> Tensor:
        y = self.packed_product(x, decode, self.bias)
        return linear(x, self.weight, self.bias) if y is None else y


class FeedForward(KeepsPackedCopy):
    stacks = ("w1", "w3")  # one packed copy for both, as they multiply the same input

    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.w1 = Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor, decode: bool = False) -> Tensor:
        gate_up = self.packed_product(x, decode)
        if gate_up is None:
            gate, up = self.w1(x, decode), self.w3(x, decode)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up, decode)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """The mean square accumulates in float64 (MPS has none: float32), so that eager's and a fused
        kernel's summation orders round to the same float32 scale and a compiled bfloat16 prefill
        normalizes as eager's does."""
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


def rope_frequencies(n_elem: int, base: float, rope_scaling: dict | None = None) -> Tensor:
    """The rotary angle per position of each of the n_elem / 2 pairs, float64."""
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: n_elem // 2] / n_elem))
    if rope_scaling and rope_scaling.get("rope_type", "llama3") == "llama3":
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
