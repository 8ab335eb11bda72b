"""The Transformer (gpt-fast style) and the attention layer that talks to its KV cache.

Llama-style by default; the checkpoint's config switches on what other families add: QK-norm
(Qwen3, Gemma 3), Gemma's (1 + weight) norms around attention and the feed-forward, a GELU-tanh
feed-forward, scaled embeddings, a query scale, and per-layer attention kinds (global, or a sliding
window with its own RoPE base: Gemma 3, Mistral).
"""

import copy
import json
import math
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
    causal_attention,
    precompute_freqs_cis,
    rope_frequencies,
    slot_attention,
)
from quantization_utils import QuantizedTensor, order_free_dtype

LAYER_KINDS = ("global", "sliding")
ACTIVATIONS = ("silu", "gelu_tanh")


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
    # Other families; the defaults are Llama's.
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (Qwen3, Gemma 3)
    norm_unit_offset: bool = False  # every RMSNorm scales by (1 + weight) (Gemma)
    post_norms: bool = False  # norms after attention and after the feed-forward too (Gemma 3)
    hidden_act: str = "silu"  # the gated feed-forward's activation: silu or gelu_tanh
    scale_embeddings: bool = False  # embeddings times sqrt(dim), rounded to the model's dtype (Gemma)
    query_pre_attn_scalar: float = 0.0  # scores scaled by 1 / sqrt(this) (0: head_dim)
    layer_types: list = field(default_factory=list)  # "global" or "sliding" per layer; empty: all global
    sliding_window: int = 0  # a sliding layer's query sees the keys less than this many positions back
    rope_local_base: float = 0.0  # RoPE base of the sliding layers (0: rope_base)
    rope_local_scaling: dict = field(default_factory=dict)  # and their RoPE scaling

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim == -1:
            self.head_dim = self.dim // self.n_head
        unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(
                f"attention kind '{unknown[0]}' is not supported; give each layer one of: {', '.join(LAYER_KINDS)}"
            )
        if self.layer_types and len(self.layer_types) != self.n_layer:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.n_layer} layers; give one per layer")
        if "sliding" in self.layer_types and self.sliding_window < 1:
            raise ValueError("sliding layers need a sliding_window of at least 1 token")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act '{self.hidden_act}' is not supported; choose from: {', '.join(ACTIVATIONS)}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer; None for a global one."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding"
        return self.sliding_window if sliding else None

    def rope(self, window: int | None) -> tuple[float, dict]:
        """(RoPE base, scaling) of a global layer (window None) or a sliding one."""
        if window is None:
            return self.rope_base, self.rope_scaling
        return self.rope_local_base or self.rope_base, self.rope_local_scaling

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


HF_LAYER_KINDS = {"full_attention": "global", "sliding_attention": "sliding"}
GEMMA3_TYPES = ("gemma3_text", "gemma3")
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def hf_rope(params: dict, default_base: float) -> tuple[float, dict]:
    """(base, our rope_scaling) of an HF rope_scaling / rope_parameters dict: default, llama3 or linear."""
    params = dict(params or {})
    base = params.pop("rope_theta", default_base)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"RoPE scaling '{rope_type}' is not supported (only llama3 and linear)")
    if rope_type == "linear" and params.get("factor", 1.0) == 1.0:
        rope_type = "default"
    return base, ({**params, "rope_type": rope_type} if rope_type != "default" else {})


def hf_config_to_args(config: dict) -> dict:
    """Maps an HF config.json (Llama, Qwen2, Qwen3, Mistral, Gemma 3) onto ModelArgs fields."""
    model_type = config.get("model_type")
    if model_type == "gemma3" and "text_config" in config:  # the multimodal config: its text model
        config = {"model_type": "gemma3_text", **config["text_config"]}
        model_type = "gemma3_text"
    gemma = model_type in GEMMA3_TYPES
    n_head = config["num_attention_heads"]
    n_layer = config["num_hidden_layers"]
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key):
            raise ValueError(f"{key} {config[key]} is not supported; only models without logit soft-capping")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if activation not in HF_ACTIVATIONS:
        raise ValueError(f"hidden activation '{activation}' is not supported; supported: {', '.join(HF_ACTIVATIONS)}")

    # RoPE: transformers >= 5 folds theta and scaling into rope_parameters, per layer kind for Gemma 3.
    default_base = 1_000_000.0 if gemma else 10000.0
    params = config.get("rope_parameters")
    if params is None:
        params = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", default_base)}
    if "full_attention" in params or "sliding_attention" in params:
        global_params, local_params = params.get("full_attention"), params.get("sliding_attention")
    else:
        global_params, local_params = params, None
    if gemma and local_params is None:
        local_params = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
    rope_base, rope_scaling = hf_rope(global_params, default_base)
    rope_local_base, rope_local_scaling = hf_rope(local_params, rope_base) if local_params else (0.0, rope_scaling)

    # Attention kind per layer.
    window = config.get("sliding_window") or 0
    kinds = config.get("layer_types")
    if kinds is None and gemma:
        pattern = config.get("sliding_window_pattern", 6)
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
    elif kinds is None and model_type == "mistral" and window:
        kinds = ["sliding_attention"] * n_layer
    elif kinds is None and config.get("use_sliding_window") and window:  # Qwen2/Qwen3 from max_window_layers on
        first = config.get("max_window_layers", n_layer)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        kinds = None  # their configs name a window they do not use
    unknown = sorted(set(kinds or []) - set(HF_LAYER_KINDS))
    if unknown:
        raise ValueError(f"attention kind '{unknown[0]}' is not supported; supported: {', '.join(HF_LAYER_KINDS)}")
    layer_types = [HF_LAYER_KINDS[k] for k in kinds or []]
    if "sliding" not in layer_types:
        layer_types, window, rope_local_base, rope_local_scaling = [], 0, 0.0, {}

    return dict(
        block_size=config.get("max_position_embeddings", 2048),
        vocab_size=config["vocab_size"],
        n_layer=n_layer,
        n_head=n_head,
        dim=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        n_local_heads=config.get("num_key_value_heads", n_head),
        head_dim=config.get("head_dim") or config["hidden_size"] // n_head,
        rope_base=rope_base,
        norm_eps=config.get("rms_norm_eps", 1e-6 if gemma else 1e-5),
        rope_scaling=rope_scaling,
        attention_bias=config.get("attention_bias", model_type == "qwen2"),
        tie_embeddings=config.get("tie_word_embeddings", gemma),
        qk_norm=gemma or model_type == "qwen3",
        norm_unit_offset=gemma,
        post_norms=gemma,
        hidden_act=HF_ACTIVATIONS[activation],
        scale_embeddings=gemma,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)) if gemma else 0.0,
        layer_types=layer_types,
        sliding_window=window,
        rope_local_base=rope_local_base,
        rope_local_scaling=rope_local_scaling,
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
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_unit_offset)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.freqs_cis: Tensor | None = None  # the global layers' RoPE table
        self.sliding_freqs_cis: Tensor | None = None  # the sliding layers', where their RoPE differs

    def setup_caches(self, caches: list[nn.Module], max_seq_length: int) -> None:
        """Installs one KV cache per layer (built by cache.create_caches) and the RoPE tables."""
        if len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} caches for {len(self.layers)} layers")
        device = self.output.weight.device
        config = self.config
        for layer, cache in zip(self.layers, caches):
            layer.attention.kv_cache = cache
            if cache is not None:
                frequencies = rope_frequencies(config.head_dim, *config.rope(layer.attention.window))
                cache.set_rope_frequencies(frequencies.float().to(device))
        self.freqs_cis = precompute_freqs_cis(max_seq_length, config.head_dim, *config.rope(None)).to(device)
        sliding = [w for w in map(config.layer_window, range(config.n_layer)) if w is not None]
        self.sliding_freqs_cis = None
        if sliding and config.rope(sliding[0]) != config.rope(None):
            self.sliding_freqs_cis = precompute_freqs_cis(max_seq_length, config.head_dim, *config.rope(sliding[0])).to(
                device
            )

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
        sliding_freqs_cis = freqs_cis if self.sliding_freqs_cis is None else self.sliding_freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        if self.config.scale_embeddings:
            x = x * torch.tensor(math.sqrt(self.config.dim), dtype=x.dtype)
        for layer in self.layers:
            rope = freqs_cis if layer.attention.window is None else sliding_freqs_cis
            x = layer(x, input_pos, rope, is_prefill, idx, extends)
        if last_only:
            x = x[:, -1:]
        return self.output(self.norm(x)).float()

    @classmethod
    def from_name(cls, name: str) -> "Transformer":
        return cls(ModelArgs.from_name(name))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.attention = Attention(config, layer)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, config.norm_unit_offset)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps, config.norm_unit_offset)
        # Gemma normalizes the outputs of attention and the feed-forward too, before the residual sum.
        post_norm = RMSNorm(config.dim, config.norm_eps, config.norm_unit_offset) if config.post_norms else None
        self.post_attention_norm = post_norm
        self.post_ffn_norm = copy.deepcopy(post_norm)

    def forward(
        self,
        x: Tensor,
        input_pos: Tensor,
        freqs_cis: Tensor,
        is_prefill: bool,
        token_ids: Tensor,
        extends: bool = False,
    ) -> Tensor:
        y = self.attention(self.attention_norm(x), freqs_cis, input_pos, is_prefill, token_ids, extends)
        if self.post_attention_norm is not None:
            y = self.post_attention_norm(y)
        h = x + y
        y = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            y = self.post_ffn_norm(y)
        return h + y


class Attention(nn.Module):
    def __init__(self, config: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_local_heads = config.n_local_heads
        self.head_dim = config.head_dim
        self.window = config.layer_window(layer)  # None: global attention
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=config.attention_bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_unit_offset)
        # Attention scales scores by 1 / sqrt(head_dim); a model that wants 1 / sqrt(s) has its
        # queries scaled by sqrt(head_dim / s) first, so the caches and strategies need not know.
        scalar = config.query_pre_attn_scalar
        self.query_scale = math.sqrt(config.head_dim / scalar) if scalar and scalar != config.head_dim else None
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
        qk = qk.view(bsz, seqlen, self.n_head + self.n_local_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.n_head, self.n_local_heads], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        # One rotation for the query and key heads together: half the ops of an eager decode step's RoPE.
        qk = apply_rotary_emb(qk, freqs_cis)
        q, k = qk.transpose(1, 2).split([self.n_head, self.n_local_heads], dim=1)
        if self.query_scale is not None:
            q = q * self.query_scale
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        if is_prefill and extends:
            y = self.kv_cache.attend_chunk(input_pos, q, k, v, token_ids)
        elif is_prefill:
            y = self.prefill_attention(q, k, v, input_pos, token_ids)
        else:
            y = self.decode_attention(q, k, v, input_pos, token_ids)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, q_size))

    def prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, token_ids: Tensor) -> Tensor:
        """Causal attention over the prompt (within the window on a sliding layer); the cache then
        takes what its compressor keeps."""
        if self.kv_cache is None:
            return causal_attention(q, k, v, self.window)
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
        self.hidden_act = config.hidden_act

    def activation(self, gate: Tensor) -> Tensor:
        """SiLU (Llama), or GELU with the tanh approximation (Gemma)."""
        return F.silu(gate) if self.hidden_act == "silu" else F.gelu(gate, approximate="tanh")

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False):
        """`unit_offset`: Gemma's norm, which scales by (1 + weight) in float32 before the cast back."""
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """The mean square accumulates in float64 (MPS has none: float32), so that eager's and a fused
        kernel's summation orders round to the same float32 scale and a compiled bfloat16 prefill
        normalizes as eager's does."""
        xf = x.float()
        scale = torch.rsqrt(xf.to(order_free_dtype(x.device)).pow(2).mean(-1, keepdim=True) + self.eps).float()
        if self.unit_offset:
            return (xf * scale * (1.0 + self.weight.float())).type_as(x)
        return (xf * scale).type_as(x) * self.weight
