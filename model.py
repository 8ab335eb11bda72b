"""The Llama-style Transformer (gpt-fast style) and the attention layer that talks to its KV cache."""

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attention import (
    apply_rotary_emb,
    attention_probs,
    attention_with_probs,
    precompute_freqs_cis,
    rope_frequencies,
    slot_attention,
)
from quantization_utils import QuantizedTensor, order_free_dtype


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
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
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
        return self.output(self.norm(x)).float()

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
        return h + self.feed_forward(self.ffn_norm(h))


class Attention(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_local_heads = config.n_local_heads
        self.head_dim = config.head_dim
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=config.attention_bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
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
        qk, v = self.wqkv(x).split([q_size + kv_size, kv_size], dim=-1)
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
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, q_size))

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
            # the full cache's attention, whether or not the strategy also wants the probabilities: at
            # full length every strategy then decodes the full cache's tokens
            y = self.attend_slots(q, keys, values, mask)
            attn = attention_probs(q, keys, mask.unsqueeze(2)) if self.kv_cache.return_attn() else None
        if self.kv_cache.return_attn():
            attn = attn.view(bsz, self.n_local_heads, group, seqlen, -1)
            self.kv_cache.update_state(input_pos, k, v, is_prefill=False, attn=attn)
        return y.view(bsz, self.n_head, seqlen, self.head_dim)

    def attend_slots(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """Attention over the cache slots a decode step may see; a back-end may swap in its own kernel."""
        return slot_attention(q, keys, values, mask)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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
