"""Converts an HF Llama/Qwen2/Qwen3/Mistral/Gemma 3 checkpoint folder (safetensors or pytorch_model.bin) into ours.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/Meta-Llama-3.1-8B-Instruct

Writes `model.pth` (a plain state_dict with fused q/k/v, loaded with weights_only=True) and our
`config.json` into the folder (or --out_dir), and copies the tokenizer files there. An HF
`config.json` that gets replaced is kept as `hf_config.json`. Running it twice is harmless.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import ModelArgs, hf_config_to_args  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# HF name (after "model.layers.{i}.") -> ours (after "layers.{i}.")
LAYER_NAMES = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
# Gemma 3 names its four norms differently: its post_attention_layernorm follows attention.
POST_NORM_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
}
QK_NORM_NAMES = {
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old .bin checkpoints carry
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


class ConversionError(ValueError):
    """A folder that is not a convertible HF checkpoint: reported in one line."""


class WeightReader:
    """Reads tensors by HF name, one at a time, from safetensors shards or pytorch_model*.bin files."""

    def __init__(self, checkpoint_dir: Path):
        self.files = find_weight_files(checkpoint_dir)
        self.location: dict[str, tuple[Path, str]] = {}  # our lookup name -> (file, name in file)
        self._handles: dict[Path, object] = {}
        self._bin: tuple[Path, dict] | None = None
        for path in self.files:
            for key in self._keys(path):
                if not key.endswith(IGNORED_SUFFIXES):
                    self.location[strip_prefix(key)] = (path, key)
        self.used: set[str] = set()

    def _keys(self, path: Path) -> list[str]:
        if path.suffix == ".safetensors":
            return list(self._safetensors(path).keys())
        return list(self._load_bin(path))

    def _safetensors(self, path: Path):
        if path not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:
                raise ConversionError(f"cannot read {path} ({type(e).__name__}: {e})") from None
        return self._handles[path]

    def _load_bin(self, path: Path) -> dict:
        if self._bin is None or self._bin[0] != path:  # one .bin shard in memory at a time
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise ConversionError(f"cannot read {path} ({type(e).__name__})") from None
            self._bin = (path, state)
        return self._bin[1]

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise ConversionError(f"tensor '{name}' is missing from the weights in {self.files[0].parent}")
        path, key = self.location[name]
        self.used.add(name)
        if path.suffix == ".safetensors":
            return self._safetensors(path).get_tensor(key)
        return self._load_bin(path)[key]

    def unused(self) -> list[str]:
        return sorted(set(self.location) - self.used)


def strip_prefix(name: str) -> str:
    """`model.layers.0...` -> `layers.0...`; `lm_head.weight` stays."""
    return name.removeprefix("model.")


def find_weight_files(checkpoint_dir: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = checkpoint_dir / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise ConversionError(f"{index} is not a valid weight index ({type(e).__name__})") from None
            files = [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConversionError(f"{index} names shards that are not there: {', '.join(missing[:3])}")
            return files
    for pattern in ("model*.safetensors", "pytorch_model*.bin"):
        files = sorted(checkpoint_dir.glob(pattern))
        if files:
            return files
    raise ConversionError(f"no HF weights (model*.safetensors or pytorch_model*.bin) in {checkpoint_dir}")


def read_config(checkpoint_dir: Path, model_name: str | None) -> ModelArgs:
    if model_name:
        return ModelArgs.from_name(model_name)
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        return ModelArgs.from_name(checkpoint_dir.name)
    try:
        raw = json.loads(config_path.read_text())
        if "hidden_size" in raw:
            check_hf_config(raw, config_path)
        config = ModelArgs.from_json(config_path)
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"cannot read model config {config_path} ({type(e).__name__}: {e})") from None
    return config


def check_hf_config(raw: dict, path: Path) -> None:
    """Rejects HF configs whose architecture our Llama-style model cannot represent."""
    model_type = raw.get("model_type")
    if model_type == "gemma3":
        raise ConversionError(
            f"{path}: model_type 'gemma3' is the multimodal Gemma 3; convert a text-only one (gemma3_text, "
            "e.g. gemma-3-270m or gemma-3-1b)"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(
            f"{path}: model_type '{model_type}' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if raw.get("mlp_bias"):
        raise ConversionError(f"{path}: unsupported mlp_bias")
    try:
        hf_config_to_args(raw)  # activation, RoPE scaling, attention kinds, soft-capping
    except ValueError as e:
        raise ConversionError(f"{path}: {e}") from None


def convert_state_dict(reader: WeightReader, config: ModelArgs) -> dict[str, torch.Tensor]:
    n_layer = len({name.split(".")[1] for name in reader.location if name.startswith("layers.")})
    if n_layer != config.n_layer:
        raise ConversionError(
            f"the config says {config.n_layer} layers but the weights hold {n_layer}; is the config right?"
        )
    state = {
        "tok_embeddings.weight": reader.get("embed_tokens.weight"),
        "norm.weight": reader.get("norm.weight"),
    }
    if not config.tie_embeddings:
        state["output.weight"] = reader.get("lm_head.weight")
    elif "lm_head.weight" in reader:
        reader.get("lm_head.weight")  # tied: the embedding serves as the output projection
    for i in range(config.n_layer):
        prefix = f"layers.{i}."  # the same in both layouts once HF's "model." is stripped
        names = POST_NORM_NAMES if config.post_norms else {}
        names = {**LAYER_NAMES, **names, **(QK_NORM_NAMES if config.qk_norm else {})}
        for hf_name, name in names.items():
            state[prefix + name] = reader.get(prefix + hf_name)
        qkv = [reader.get(f"{prefix}self_attn.{p}_proj.weight") for p in "qkv"]
        state[prefix + "attention.wqkv.weight"] = torch.cat(qkv)
        if config.attention_bias:
            biases = [reader.get(f"{prefix}self_attn.{p}_proj.bias") for p in "qkv"]
            state[prefix + "attention.wqkv.bias"] = torch.cat(biases)
    unused = reader.unused()
    if unused:
        raise ConversionError(
            f"the weights hold tensors this model config does not use ({', '.join(unused[:3])}"
            f"{' ...' if len(unused) > 3 else ''}); is the config right?"
        )
    check_shapes(state, config)
    return state


def check_shapes(state: dict[str, torch.Tensor], config: ModelArgs) -> None:
    """Compares every tensor with the shape the model config implies, so a wrong config fails here."""
    from model import Transformer

    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    for name, tensor in state.items():
        if name not in expected:
            raise ConversionError(f"converted tensor '{name}' has no place in the model")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConversionError(
                f"tensor '{name}' has shape {tuple(tensor.shape)} but the config implies "
                f"{tuple(expected[name].shape)}; is the config right?"
            )


def copy_tokenizer_files(checkpoint_dir: Path, out_dir: Path) -> list[str]:
    """Copies tokenizer files that are not already in out_dir; Llama-3's original/tokenizer.model too."""
    copied = []
    sources = {name: checkpoint_dir / name for name in TOKENIZER_FILES}
    original = checkpoint_dir / "original" / "tokenizer.model"
    if not sources["tokenizer.model"].is_file() and original.is_file():
        sources["tokenizer.model"] = original
    for name, src in sources.items():
        dst = out_dir / name
        if src.is_file() and not dst.is_file():
            shutil.copyfile(src, dst)
            copied.append(name)
    return copied


def write_config(config: ModelArgs, out_dir: Path) -> None:
    path = out_dir / "config.json"
    if path.is_file():
        try:
            existing = json.loads(path.read_text())
        except ValueError:
            existing = {}
        backup = out_dir / "hf_config.json"
        if "hidden_size" in existing and not backup.is_file():
            shutil.copyfile(path, backup)  # keep the HF config: transformers needs it to load this folder
    tmp = out_dir / "config.json.tmp"
    config.to_json(tmp)
    tmp.replace(path)


def convert_hf_checkpoint(checkpoint_dir: Path, model_name: str | None = None, out_dir: Path | None = None) -> Path:
    """Converts checkpoint_dir; returns the folder holding model.pth, config.json and tokenizer files."""
    checkpoint_dir = Path(checkpoint_dir)
    out_dir = Path(out_dir) if out_dir is not None else checkpoint_dir
    if not checkpoint_dir.is_dir():
        raise ConversionError(f"checkpoint folder {checkpoint_dir} does not exist")
    config = read_config(checkpoint_dir, model_name)  # a config we cannot run fails before the weights are read
    reader = WeightReader(checkpoint_dir)
    state = convert_state_dict(reader, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "model.pth.tmp"
    torch.save(state, tmp)
    tmp.replace(out_dir / "model.pth")
    write_config(config, out_dir)
    copy_tokenizer_files(checkpoint_dir, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", type=Path, required=True, help="folder with the HF checkpoint")
    parser.add_argument("--model_name", help="a named config from model.py instead of the folder's config.json")
    parser.add_argument("--out_dir", type=Path, help="where to write (default: --checkpoint_dir)")
    args = parser.parse_args(argv)
    try:
        out_dir = convert_hf_checkpoint(args.checkpoint_dir, args.model_name, args.out_dir)
    except (ConversionError, ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out_dir / 'model.pth'}")
    if not any((out_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        print(f"note: no tokenizer file in {out_dir}; generate.py needs tokenizer.json or tokenizer.model")


if __name__ == "__main__":
    main()
