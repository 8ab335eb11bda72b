#!/usr/bin/env bash
# shellcheck disable=SC2086  # the space-separated lists are split on purpose
# shellcheck source-path=SCRIPTDIR
# Multi-strategy local/global: some layers keep the full cache (global), the others a compressed
# local one, alternating layer by layer (repeat) or the lower half full, the upper half local (tile).
#
#   bash scripts/sweep_local_global.sh
#   LOCAL_STRATEGIES=recent_global LAYOUTS=repeat BUDGETS="0.1 0.25" bash scripts/sweep_local_global.sh
#
# LOCAL_STRATEGIES are cache strategies for the local layers (each with its natural prompt
# compressor); LAYOUTS are repeat and/or tile (the model's layer count must be even).
# See sweep_lib.sh for TASKS, BUDGETS, NUM_SAMPLES, SEQ_LENGTH, OUT_DIR, PYTHON and DRY_RUN.
# shellcheck source=sweep_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sweep_lib.sh"
SWEEP_EXTRA=("$@")
LOCAL_STRATEGIES=${LOCAL_STRATEGIES:-$(registry compressing)}
GLOBAL_STRATEGY=$(registry baseline)
GLOBAL_COMPRESSOR=$(registry compressor "$GLOBAL_STRATEGY")
LAYOUTS=${LAYOUTS:-"repeat tile"}
BUDGETS=${BUDGETS:-"0.1 0.25 0.5"}
TASKS=${TASKS:-"rulerniah rulervt rulercwe rulerqa"}

PAIRS=$(with_compressors $LOCAL_STRATEGIES)
for pair in $PAIRS; do
    local=${pair%%:*} compressor=${pair#*:}
    for layout in $LAYOUTS; do
        for budget in $BUDGETS; do
            run_eval --cache_strategy "$GLOBAL_STRATEGY" "$local" --prompt_compression_strategy "$GLOBAL_COMPRESSOR" "$compressor" \
                --cache_strategy_pattern "$layout" --max_cache_length 1.0 "$budget" --cache_length_pattern "$layout" \
                --global_tokens 4 --recent_window 10 --tasks $TASKS
        done
    done
done
sweep_done
