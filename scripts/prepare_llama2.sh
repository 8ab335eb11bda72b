#!/usr/bin/env bash
# Downloads Llama-2-7b-chat (gated) from the HF hub and converts it to checkpoints/Llama-2-7b-chat-hf/.
# Gated: accept the license on https://huggingface.co/meta-llama/Llama-2-7b-chat-hf, then
# export HF_TOKEN=hf_... (or run huggingface-cli login). About 16 GB of bf16 weights.
# Idempotent: returns at once when the converted checkpoint is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
REPO=meta-llama/Llama-2-7b-chat-hf
OUT=${OUT:-checkpoints/${REPO#*/}}
if [ -f "$OUT/model.pth" ] && [ -f "$OUT/config.json" ]; then
  echo "$OUT is ready"
  exit 0
fi
"$PYTHON" scripts/download.py --repo_id "$REPO" --checkpoint_dir "$OUT" "$@"
