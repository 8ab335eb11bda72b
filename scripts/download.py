"""Downloads an HF checkpoint (weights, config, tokenizer files) from the hub and converts it.

    HF_TOKEN=hf_... python scripts/download.py --repo_id meta-llama/Meta-Llama-3.1-8B-Instruct

Writes checkpoints/<NAME>/ (or --checkpoint_dir) with model.pth, config.json and the tokenizer
files. Gated repos (Llama) need their license accepted on huggingface.co and a token: --hf_token,
the HF_TOKEN environment variable, or a `huggingface-cli login`. This is the only script that
reaches the network, and only when run.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_hf_checkpoint import ConversionError, convert_hf_checkpoint, find_weight_files  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMMON_PATTERNS = ["*.json", "tokenizer.model"]
WEIGHT_PATTERNS = (["*.safetensors"], ["pytorch_model*.bin"])  # safetensors preferred: never both


def weight_patterns(repo_files: list[str]) -> list[str]:
    """Only one weight format is fetched (repos often ship both, doubling the download)."""
    from fnmatch import fnmatch

    top_level = [f for f in repo_files if "/" not in f]
    for patterns in WEIGHT_PATTERNS:
        if any(fnmatch(f, p) for f in top_level for p in patterns):
            return patterns
    raise ValueError("the repo holds no *.safetensors or pytorch_model*.bin weights at its top level")


def download(repo_id: str, checkpoint_dir: Path, token: str | None) -> None:
    from huggingface_hub import list_repo_files, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        patterns = weight_patterns(list_repo_files(repo_id, token=token))
        snapshot_download(
            repo_id,
            local_dir=checkpoint_dir,
            allow_patterns=COMMON_PATTERNS + patterns,
            ignore_patterns=["original/*"],  # Meta's consolidated.*.pth duplicates
            token=token,
        )
    except GatedRepoError:
        raise ValueError(
            f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id}, "
            "then pass a token (--hf_token or HF_TOKEN) of an account that has access"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(f"repo {repo_id} not found (or private: pass a token with --hf_token or HF_TOKEN)") from None
    except (HfHubHTTPError, OSError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"download of {repo_id} failed: {first_line}") from None


def delete_hf_weights(checkpoint_dir: Path) -> None:
    for path in find_weight_files(checkpoint_dir):
        path.unlink()
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        (checkpoint_dir / index).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo_id", required=True, help="hub repo, e.g. Qwen/Qwen2-0.5B-Instruct")
    parser.add_argument("--hf_token", help="hub token (default: $HF_TOKEN, then a stored login)")
    parser.add_argument("--checkpoint_dir", type=Path, help="default: checkpoints/<NAME of ORG/NAME>")
    parser.add_argument("--model_name", help="a named config from model.py instead of the repo's config.json")
    parser.add_argument(
        "--delete_hf_weights", action="store_true", help="delete the HF weight files once model.pth is written"
    )
    args = parser.parse_args(argv)
    if args.repo_id.count("/") != 1 or not all(args.repo_id.split("/")):
        sys.exit(f"error: --repo_id must look like ORG/NAME, got '{args.repo_id}'")
    checkpoint_dir = args.checkpoint_dir or ROOT / "checkpoints" / args.repo_id.split("/")[1]
    token = args.hf_token or os.environ.get("HF_TOKEN") or None
    try:
        download(args.repo_id, checkpoint_dir, token)
        print(f"downloaded {args.repo_id} to {checkpoint_dir}; converting")
        convert_hf_checkpoint(checkpoint_dir, args.model_name)
        if args.delete_hf_weights:
            delete_hf_weights(checkpoint_dir)
    except ImportError as e:
        sys.exit(f"error: {e.name or e} is needed to download; run: pip install huggingface_hub")
    except (ConversionError, ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {checkpoint_dir / 'model.pth'}")


if __name__ == "__main__":
    main()
