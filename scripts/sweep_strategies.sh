#!/usr/bin/env bash
# shellcheck disable=SC2086  # the space-separated lists are split on purpose
# shellcheck source-path=SCRIPTDIR
# Strategies x budgets x tasks, plus the full-cache baseline: the main comparison grid.
#
#   bash scripts/sweep_strategies.sh --checkpoint_path checkpoints/SmolLM2-135M-Instruct
#   STRATEGIES="heavy_hitter l2" BUDGETS="0.1 0.25" TASKS="rulerniah rulervt" NUM_SAMPLES=50 \
#       bash scripts/sweep_strategies.sh
#   DRY_RUN=1 bash scripts/sweep_strategies.sh > grid.txt    # then run the lines in parallel:
#   python scripts/parallel_eval.py --command_file grid.txt --num_workers 4
#
# STRATEGIES are presets in cache_configs/ (each its own prompt compressor). See sweep_lib.sh for
# TASKS, BUDGETS, NUM_SAMPLES, SEQ_LENGTH, OUT_DIR, PYTHON and DRY_RUN.
# shellcheck source=sweep_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sweep_lib.sh"
SWEEP_EXTRA=("$@")
STRATEGIES=${STRATEGIES:-$(registry compressing)}
BUDGETS=${BUDGETS:-"0.1 0.25 0.5"}
TASKS=${TASKS:-"rulerniah rulervt rulercwe rulerqa"}

run_eval --cache_config "$(registry baseline)" --tasks $TASKS
for strategy in $STRATEGIES; do
    for budget in $BUDGETS; do
        run_eval --cache_config "$strategy" --max_cache_length "$budget" --tasks $TASKS
    done
done
sweep_done
