"""Parity with HF transformers, an independent implementation of the same models.

* The embedded SmolLM2-135M-Instruct: transformers loads the very GGUF our checkpoint was converted
  from; fp32 logits on a ~300-token prompt and a 64-token greedy continuation must agree (`slow`).
* Tiny random HF checkpoints (Llama-3.1 style: GQA + llama3 RoPE scaling; Qwen2 style: q/k/v bias,
  tied embeddings; Llama-2 style: plain multi-head) written with save_pretrained and converted by
  scripts/convert_hf_checkpoint.py: logits and a 16-token greedy continuation must agree (fast).
* The HF config.json of every named model maps onto our named config.
"""

import json
import shutil

import pytest
import torch
from convert_hf_checkpoint import convert_hf_checkpoint, main
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cache_args import default_cache_kwargs
from generation import generate as our_generate
from generation import load_model
from model import ModelArgs
from tokenizer import get_tokenizer

LOGITS_ATOL = 1e-3

PASSAGE = (
    "Summarize the following report in detail, step by step.\n\n"
    "In March 2023 the harbour authority of Port Elsworth counted 1,482 ship arrivals, 17% more than a "
    "year before. Most of the growth came from container vessels, whose average length rose from 214 to "
    "259 metres, while the number of ferries stayed flat at 312. To cope with the traffic, the authority "
    "dredged the northern channel to a depth of 14.5 metres, installed two new cranes at Quay 7 and "
    "extended the night shift by three hours. Not everything went smoothly: a storm on 9 November "
    "closed the port for 41 hours, and a software fault in the booking system delayed 63 departures "
    "during the first week of December. The report also notes that fuel deliveries fell by 8% after "
    "the ferry operator switched four of its ships to batteries, which are charged from a new "
    "substation built beside the passenger terminal. Noise complaints from the old town dropped by "
    "half, and the harbour's water quality, measured every Monday at six points, improved at five of "
    "them. For 2024 the authority plans a second substation, a bicycle route along the eastern pier, "
    "and a training centre for crane operators; the budget for these projects is 23.6 million euros, "
    "of which the regional government pays 40%."
)


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [T, vocab] of one prefill pass over ids [T] (no cache needed)."""
    model.setup_caches([None] * model.config.n_layer, ids.numel())
    with torch.no_grad():
        return model(ids.view(1, -1), torch.arange(ids.numel()), is_prefill=True)[0]


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.view(1, -1)).logits[0].float()


def hf_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """n greedy tokens from transformers, never stopping early at an end-of-sequence token; the mask is
    explicit, or transformers would mask every prompt token that equals the padding id."""
    ids = ids.view(1, -1)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    return out[0, ids.numel() :].tolist()


def our_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    tokens, _ = our_generate(model, ids, n, default_cache_kwargs(), terminator_ids=())
    return tokens.tolist()


# ---------------------------------------------------------------- the embedded SmolLM2 (GGUF)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf):
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def our_smollm2(smollm2_checkpoint):
    return load_model(smollm2_checkpoint, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2_checkpoint) -> torch.Tensor:
    tokenizer = get_tokenizer(smollm2_checkpoint)
    ids = tokenizer.encode(tokenizer.apply_chat_template(PASSAGE))
    assert 280 <= len(ids) <= 340, len(ids)
    return torch.tensor(ids)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(hf_smollm2, our_smollm2, smollm2_prompt):
    ours = our_logits(our_smollm2, smollm2_prompt)
    ref = hf_logits(hf_smollm2, smollm2_prompt)
    assert ours.shape == ref.shape == (smollm2_prompt.numel(), 49152)
    diff = (ours - ref).abs().max().item()
    assert diff < LOGITS_ATOL, f"max abs logit difference {diff:.2e}"


@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers(hf_smollm2, our_smollm2, smollm2_prompt):
    ours = our_greedy(our_smollm2, smollm2_prompt, 64)
    ref = hf_greedy(hf_smollm2, smollm2_prompt, 64)
    assert len(ours) == len(ref) == 64
    assert ours == ref


# ---------------------------------------------------------------- tiny random HF checkpoints

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
)
LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
TINY_MODELS = {
    # GQA + Llama-3.1 RoPE scaling; wavelengths on both sides of the two cut-offs (16 and 64 positions)
    "llama31": (
        LlamaForCausalLM,
        LlamaConfig(**TINY, num_key_value_heads=2, rope_theta=10000.0, rope_scaling=LLAMA3_SCALING),
    ),
    # q/k/v bias, tied embeddings, 4:1 GQA
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**TINY, num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=True)),
    # plain multi-head attention
    "llama2": (LlamaForCausalLM, LlamaConfig(**TINY, num_key_value_heads=4)),
    # Llama 3.2: llama3 RoPE scaling with tied embeddings
    "llama32": (
        LlamaForCausalLM,
        LlamaConfig(**TINY, num_key_value_heads=2, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True),
    ),
    # QK-norm, a head dimension apart from the width (4 x 32 != 64)
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**TINY, num_key_value_heads=2, head_dim=32, rope_theta=1e6)),
    # a sliding window on every layer, shorter than the prompts
    "mistral": (MistralForCausalLM, MistralConfig(**TINY, num_key_value_heads=2, sliding_window=24)),
    # sliding and global layers, each with its RoPE; QK-norm, (1 + w) norms around attention and the
    # feed-forward, GELU-tanh, scaled embeddings, a query scale other than the head dimension, MQA
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 3},
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=20,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
}


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights large enough that every feature (bias, norm weights, RoPE scaling) moves the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model.eval()


def tiny_ids(n: int = 160, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(TINY_MODELS))
def tiny(request, tmp_path):
    """(HF model, our converted model, kind); llama31 is saved in several safetensors shards."""
    model_cls, config = TINY_MODELS[request.param]
    hf = randomize(model_cls(config))
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir, max_shard_size="100KB" if request.param == "llama31" else "50GB")
    convert_hf_checkpoint(hf_dir, out_dir=tmp_path / "ours")
    ours = load_model(tmp_path / "ours", torch.device("cpu"), torch.float32)
    return hf, ours, request.param


def test_tiny_logits_match_transformers(tiny):
    hf, ours, kind = tiny
    ids = tiny_ids()
    ref = hf_logits(hf, ids)
    diff = (our_logits(ours, ids) - ref).abs().max().item()
    assert diff < LOGITS_ATOL, f"{kind}: max abs logit difference {diff:.2e}"
    # The comparison is sensitive to the feature this config exercises.
    if kind == "llama31":
        assert ours.config.rope_scaling["rope_type"] == "llama3"
        ours.config.rope_scaling = {}
        assert (our_logits(ours, ids) - ref).abs().max() > 10 * LOGITS_ATOL
    elif kind == "qwen2":
        assert ours.config.attention_bias and ours.config.tie_embeddings
        ours.layers[0].attention.wqkv.bias.zero_()
        assert (our_logits(ours, ids) - ref).abs().max() > 10 * LOGITS_ATOL
    elif kind in ("mistral", "gemma3"):  # the window matters: without it the logits move
        for layer in ours.layers:
            layer.attention.window = None
        assert (our_logits(ours, ids) - ref).abs().max() > 10 * LOGITS_ATOL


def test_tiny_greedy_continuation_matches_transformers(tiny):
    hf, ours, kind = tiny
    ids = tiny_ids(48, seed=2)
    ref = hf_greedy(hf, ids, 16)
    assert our_greedy(ours, ids, 16) == ref, kind


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
@pytest.mark.parametrize("chunk_size", [1, 7, 20])
def test_tiny_sliding_window_through_caches_matches_transformers(kind, chunk_size, tmp_path):
    """Sliding layers keep their window through the caches: prompts several windows long, prefilled
    in one pass, token by token or in chunks, and a compressing strategy on the global layers."""
    model_cls, config = TINY_MODELS[kind]
    hf = randomize(model_cls(config))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(
        convert_hf_checkpoint(tmp_path / "hf", out_dir=tmp_path / "ours"), torch.device("cpu"), torch.float32
    )
    ids = tiny_ids(70, seed=3)
    ref = hf_greedy(hf, ids, 12)
    kwargs = default_cache_kwargs(prefill_chunk_size=chunk_size)
    tokens, _ = our_generate(ours, ids, 12, kwargs, terminator_ids=())
    assert tokens.tolist() == ref
    windows = [layer.attention.window for layer in ours.layers]
    caches = [layer.attention.kv_cache for layer in ours.layers]
    for window, cache in zip(windows, caches):
        assert cache.window == window
        if window is not None:
            assert cache.max_cache_length == window and int((cache.pos >= 0).sum(-1).max()) == window
    if kind == "gemma3":  # the global layer compresses, the sliding ones keep their window
        tokens, stats = our_generate(
            ours, ids, 12, default_cache_kwargs(cache_strategy=["l2"], max_cache_length=[0.5]), terminator_ids=()
        )
        assert tokens.numel() == 12
        lengths = [layer.attention.kv_cache.max_cache_length for layer in ours.layers]
        assert lengths == [16, 48, 16]
        by_kind = stats["compression_ratio_by_kind"]  # against the model's own full cache: the window
        assert by_kind["sliding"] == 0.0 and by_kind["global"] == pytest.approx(1 - 48 / (70 + 11))


def test_tiny_sliding_window_batch_matches_transformers(tmp_path):
    """Prompts shorter and longer than the window decode together as they do alone, and as HF's."""
    from generation import generate_batch

    model_cls, config = TINY_MODELS["mistral"]
    hf = randomize(model_cls(config))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(
        convert_hf_checkpoint(tmp_path / "hf", out_dir=tmp_path / "ours"), torch.device("cpu"), torch.float32
    )
    prompts = [tiny_ids(70, seed=3), tiny_ids(6, seed=4), tiny_ids(30, seed=5)]
    batch = [tokens.tolist() for tokens, _ in generate_batch(ours, prompts, 12, default_cache_kwargs())]
    assert batch == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.parametrize("context_length", [40, 60])
def test_tiny_sliding_window_context_only_matches_transformers(context_length, tmp_path):
    """A context compressed before its question is seen (--context_only): the sliding layers keep no
    room for the question, whose tokens push the oldest of the window out."""
    model_cls, config = TINY_MODELS["gemma3"]
    hf = randomize(model_cls(config))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(
        convert_hf_checkpoint(tmp_path / "hf", out_dir=tmp_path / "ours"), torch.device("cpu"), torch.float32
    )
    ids = tiny_ids(70, seed=3)
    kwargs = default_cache_kwargs(context_only=True)
    tokens, _ = our_generate(ours, ids, 12, kwargs, terminator_ids=(), context_length=context_length)
    assert tokens.tolist() == hf_greedy(hf, ids, 12)


# ---------------------------------------------------------------- the converter itself


@pytest.fixture
def tiny_hf_dir(tmp_path):
    model_cls, config = TINY_MODELS["qwen2"]
    hf = randomize(model_cls(config))
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    return hf, hf_dir


def test_convert_pytorch_bin_equals_safetensors(tiny_hf_dir, tmp_path):
    hf, hf_dir = tiny_hf_dir
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(hf_dir / "config.json", bin_dir)
    torch.save(hf.state_dict(), bin_dir / "pytorch_model.bin")  # holds lm_head.weight (tied) too
    convert_hf_checkpoint(hf_dir, out_dir=tmp_path / "a")
    convert_hf_checkpoint(bin_dir, out_dir=tmp_path / "b")
    a = torch.load(tmp_path / "a" / "model.pth", weights_only=True)
    b = torch.load(tmp_path / "b" / "model.pth", weights_only=True)
    assert a.keys() == b.keys() and "output.weight" not in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_convert_in_place_twice_keeps_hf_config(tiny_hf_dir):
    _, hf_dir = tiny_hf_dir
    hf_config = json.loads((hf_dir / "config.json").read_text())
    main(["--checkpoint_dir", str(hf_dir)])
    first = torch.load(hf_dir / "model.pth", weights_only=True)
    main(["--checkpoint_dir", str(hf_dir)])  # now reads our own config.json
    second = torch.load(hf_dir / "model.pth", weights_only=True)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((hf_dir / "hf_config.json").read_text()) == hf_config
    assert ModelArgs.from_json(hf_dir / "config.json") == ModelArgs.from_json(hf_dir / "hf_config.json")
    assert not list(hf_dir.glob("*.tmp"))


def test_convert_copies_tokenizer_files(tiny_hf_dir, tmp_path):
    _, hf_dir = tiny_hf_dir
    (hf_dir / "tokenizer.json").write_text('{"from": "hf"}')
    (hf_dir / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer_config.json").write_text('{"mine": true}')  # already in place: kept
    convert_hf_checkpoint(hf_dir, out_dir=out)
    assert (out / "tokenizer.json").read_text() == '{"from": "hf"}'
    assert (out / "tokenizer_config.json").read_text() == '{"mine": true}'
    assert not (out / "tokenizer.model").exists()


def run_main_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    message = str(exc.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_convert_errors_are_one_line(tiny_hf_dir, tmp_path, capsys):
    _, hf_dir = tiny_hf_dir
    assert "does not exist" in run_main_error(capsys, ["--checkpoint_dir", str(tmp_path / "nowhere")])
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(hf_dir / "config.json", empty)
    assert "no HF weights" in run_main_error(capsys, ["--checkpoint_dir", str(empty)])
    # a named config that does not fit the weights
    assert "config" in run_main_error(capsys, ["--checkpoint_dir", str(hf_dir), "--model_name", "SmolLM2-135M"])
    assert "no model config matches" in run_main_error(
        capsys, ["--checkpoint_dir", str(hf_dir), "--model_name", "NoSuchModel"]
    )
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert "yarn" in run_main_error(capsys, ["--checkpoint_dir", str(hf_dir)])
    (hf_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert "cannot read" in run_main_error(capsys, ["--checkpoint_dir", str(hf_dir)])
    assert not (hf_dir / "model.pth").exists()


def test_download_fetches_one_weight_format_then_converts(tiny_hf_dir, tmp_path, monkeypatch):
    """scripts/download.py against a fake hub (no network): safetensors only, then conversion."""
    import download
    import huggingface_hub

    _, hf_dir = tiny_hf_dir
    calls = {}

    def fake_list_repo_files(repo_id, token=None):
        calls["token"] = token
        return ["config.json", "model.safetensors", "pytorch_model.bin", "original/consolidated.00.pth"]

    def fake_snapshot_download(repo_id, local_dir, allow_patterns, ignore_patterns, token):
        calls["allow_patterns"] = allow_patterns
        shutil.copytree(hf_dir, local_dir, dirs_exist_ok=True)
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", fake_list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
    out = tmp_path / "Qwen2-tiny"
    download.main(["--repo_id", "Qwen/Qwen2-tiny", "--checkpoint_dir", str(out), "--delete_hf_weights"])
    assert calls["token"] == "hf_secret_token"
    assert "*.safetensors" in calls["allow_patterns"] and not any(".bin" in p for p in calls["allow_patterns"])
    assert (out / "model.pth").is_file() and not (out / "model.safetensors").exists()
    assert ModelArgs.from_checkpoint_dir(out).attention_bias


def test_download_rejects_a_malformed_repo_id(capsys):
    import download

    with pytest.raises(SystemExit) as exc:
        download.main(["--repo_id", "just-a-name"])
    assert str(exc.value.code).startswith("error: --repo_id must look like ORG/NAME")


# ---------------------------------------------------------------- HF config.json -> named configs

LLAMA_COMMON = dict(
    model_type="llama",
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    hidden_size=4096,
    num_attention_heads=32,
    num_hidden_layers=32,
    rms_norm_eps=1e-05,
    tie_word_embeddings=False,
)
LLAMA3_COMMON = dict(
    LLAMA_COMMON, intermediate_size=14336, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0
)
QWEN2_COMMON = dict(
    model_type="qwen2", hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-06, rope_theta=1000000.0
)
# The config.json files of the hub repos (abridged to the fields that matter), as transformers 4 wrote them.
HF_CONFIGS = {
    "SmolLM2-135M-Instruct": dict(
        LLAMA_COMMON,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        max_position_embeddings=8192,
        rope_theta=100000,
        tie_word_embeddings=True,
        vocab_size=49152,
    ),
    "Llama-2-7b-chat": dict(
        LLAMA_COMMON,
        intermediate_size=11008,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rope_scaling=None,
        vocab_size=32000,
    ),
    "Meta-Llama-3-8B-Instruct": dict(LLAMA3_COMMON, max_position_embeddings=8192),
    "Meta-Llama-3.1-8B-Instruct": dict(
        LLAMA3_COMMON,
        max_position_embeddings=131072,
        rope_scaling=dict(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
    ),
    "Qwen2-0.5B-Instruct": dict(
        QWEN2_COMMON,
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=24,
        tie_word_embeddings=True,
        vocab_size=151936,
        sliding_window=32768,
        use_sliding_window=False,
    ),
    "Qwen2-1.5B-Instruct": dict(
        QWEN2_COMMON,
        hidden_size=1536,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        num_hidden_layers=28,
        tie_word_embeddings=True,
        vocab_size=151936,
        sliding_window=32768,
        use_sliding_window=False,
    ),
    "Qwen2-7B-Instruct": dict(
        QWEN2_COMMON,
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        num_hidden_layers=28,
        tie_word_embeddings=False,
        vocab_size=152064,
        sliding_window=131072,
        use_sliding_window=False,
    ),
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
@pytest.mark.parametrize("writer", ["transformers4", "transformers5"])
def test_hf_config_matches_named_config(name, writer, tmp_path):
    config = dict(HF_CONFIGS[name])
    if writer == "transformers5":  # rope_theta and rope_scaling folded into rope_parameters
        config_cls = Qwen2Config if config["model_type"] == "qwen2" else LlamaConfig
        config = config_cls(**config).to_dict()
        assert "rope_parameters" in config
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert ModelArgs.from_json(path) == ModelArgs.from_name(name)
