#!/usr/bin/env bash
# Downloads Meta-Llama-3.1-8B-Instruct (gated) from the HF hub and converts it to checkpoints/Meta-Llama-3.1-8B-Instruct/.
# Gated: accept the license on https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct, then
# export HF_TOKEN=hf_... (or run huggingface-cli login). About 16 GB of bf16 weights.
# Idempotent: returns at once when the converted checkpoint is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
REPO=meta-llama/Llama-3.1-8B-Instruct
OUT=${OUT:-checkpoints/Meta-Llama-3.1-8B-Instruct}  # the named config's name (the hub dropped "Meta-")
if [ -f "$OUT/model.pth" ] && [ -f "$OUT/config.json" ]; then
  echo "$OUT is ready"
  exit 0
fi
"$PYTHON" scripts/download.py --repo_id "$REPO" --checkpoint_dir "$OUT" "$@"
