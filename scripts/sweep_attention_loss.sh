#!/usr/bin/env bash
# shellcheck disable=SC2086  # the space-separated lists are split on purpose
# shellcheck source-path=SCRIPTDIR
# Attention loss: each debug_<strategy> attends with the full cache while simulating <strategy> at
# each budget, and records the attention mass that falls on tokens <strategy> would have evicted
# Outputs are the full cache's; the statistics are the simulated cache's.
#
#   bash scripts/sweep_attention_loss.sh
#   STRATEGIES="recent_global heavy_hitter" BUDGETS="0.25" TASKS=rulerniah bash scripts/sweep_attention_loss.sh
#   (plot one prompt's loss curves with scripts/plot_attention_loss.py)
#
# See sweep_lib.sh for TASKS, BUDGETS, NUM_SAMPLES, SEQ_LENGTH, OUT_DIR, PYTHON and DRY_RUN.
# shellcheck source=sweep_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sweep_lib.sh"
SWEEP_EXTRA=("$@")
STRATEGIES=${STRATEGIES:-$(registry compressing)}
BUDGETS=${BUDGETS:-"0.1 0.25 0.5"}
TASKS=${TASKS:-"rulerniah rulervt"}

PAIRS=$(with_compressors $STRATEGIES)
for pair in $PAIRS; do
    strategy=${pair%%:*} compressor=${pair#*:}
    for budget in $BUDGETS; do
        run_eval --cache_strategy "debug_$strategy" --prompt_compression_strategy "$compressor" \
            --max_cache_length "$budget" --global_tokens 4 --recent_window 10 --tasks $TASKS
    done
done
sweep_done
