#!/usr/bin/env bash
# shellcheck disable=SC2086  # the space-separated lists are split on purpose
# shellcheck source-path=SCRIPTDIR
# Variable per-layer compression: the same average budget spread evenly over layers (tile), with
# larger caches in lower layers (pyramid, PyramidKV), or in upper layers (funnel).
#
#   bash scripts/sweep_variable_compression.sh
#   STRATEGIES="heavy_hitter recent_global" PATTERNS="tile pyramid" BUDGETS="0.25" bash scripts/sweep_variable_compression.sh
#
# STRATEGIES are presets in cache_configs/; PATTERNS are --cache_length_pattern values.
# See sweep_lib.sh for TASKS, BUDGETS, NUM_SAMPLES, SEQ_LENGTH, OUT_DIR, PYTHON and DRY_RUN.
# shellcheck source=sweep_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sweep_lib.sh"
SWEEP_EXTRA=("$@")
STRATEGIES=${STRATEGIES:-$(registry compressing)}
PATTERNS=${PATTERNS:-"tile pyramid funnel"}
BUDGETS=${BUDGETS:-"0.1 0.25 0.5"}
TASKS=${TASKS:-"rulerniah rulervt rulercwe rulerqa"}

for strategy in $STRATEGIES; do
    for pattern in $PATTERNS; do
        for budget in $BUDGETS; do
            run_eval --cache_config "$strategy" --cache_length_pattern "$pattern" --max_cache_length "$budget" \
                --tasks $TASKS
        done
    done
done
sweep_done
