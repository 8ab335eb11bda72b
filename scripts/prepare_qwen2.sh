#!/usr/bin/env bash
# Downloads Qwen2 Instruct models from the HF hub and converts them to checkpoints/Qwen2-<SIZE>-Instruct/.
#   bash scripts/prepare_qwen2.sh            # 0.5B, 1.5B and 7B (about 1, 3 and 15 GB)
#   bash scripts/prepare_qwen2.sh 0.5B 1.5B  # only these sizes
# Not gated; a token (HF_TOKEN) only raises rate limits. Idempotent per size.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(0.5B 1.5B 7B)
for SIZE in "${SIZES[@]}"; do
  case "$SIZE" in
    0.5B | 1.5B | 7B) ;;
    *) echo "error: unknown Qwen2 size '$SIZE'; choose from 0.5B 1.5B 7B" >&2; exit 2 ;;
  esac
  REPO=Qwen/Qwen2-$SIZE-Instruct
  OUT=checkpoints/${REPO#*/}
  if [ -f "$OUT/model.pth" ] && [ -f "$OUT/config.json" ]; then
    echo "$OUT is ready"
    continue
  fi
  "$PYTHON" scripts/download.py --repo_id "$REPO" --checkpoint_dir "$OUT"
done
