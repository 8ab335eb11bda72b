# shellcheck shell=bash
# Sourced by the sweep_*.sh scripts: runs (or, with DRY_RUN=1, prints) one eval.py command per call.
#
# Every sweep reads these environment variables (defaults in each script; a list of strategies
# defaults to every compressing strategy in the registry):
#   TASKS        eval.py tasks, all run by one command per configuration (one model load)
#   BUDGETS      --max_cache_length values
#   NUM_SAMPLES  samples per task (empty: all)
#   SEQ_LENGTH   context length of the RULER tasks (empty: the task's default)
#   OUT_DIR      results folder (default: results)
#   PYTHON       interpreter (default: python)
#   DRY_RUN=1    print the commands instead of running them: a --command_file for
#                scripts/parallel_eval.py, which runs them on local workers or a Ray cluster
# Arguments given to a sweep script are appended to every eval.py command
# (e.g. --checkpoint_path checkpoints/Meta-Llama-3.1-8B-Instruct --dtype bfloat16).

set -euo pipefail
PYTHON=${PYTHON:-python}
SWEEP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR=${OUT_DIR:-results}
NUM_SAMPLES=${NUM_SAMPLES-}
SEQ_LENGTH=${SEQ_LENGTH-}
SWEEP_FAILED=0

# run_eval ARGS...: one eval.py run with the common options; a failure is counted, not fatal.
run_eval() {
    local cmd=("$PYTHON" "$SWEEP_ROOT/eval.py" "$@" --out_dir "$OUT_DIR")
    [[ -n "$NUM_SAMPLES" ]] && cmd+=(--num_samples "$NUM_SAMPLES")
    [[ -n "$SEQ_LENGTH" ]] && cmd+=(--seq_length "$SEQ_LENGTH")
    cmd+=(${SWEEP_EXTRA[@]+"${SWEEP_EXTRA[@]}"}) # bash before 4.4 calls an empty array unbound under set -u
    if [[ -n "${DRY_RUN:-}" ]]; then
        printf '%q ' "${cmd[@]}"
        echo
        return 0
    fi
    echo ">> ${cmd[*]}" >&2
    "${cmd[@]}" || {
        echo "!! failed (exit $?): ${cmd[*]}" >&2
        SWEEP_FAILED=$((SWEEP_FAILED + 1))
    }
}

# registry ARGS...: asks the strategy registry (python -m strategies), e.g. `registry compressing`.
registry() {
    (cd "$SWEEP_ROOT" && "$PYTHON" -m strategies "$@")
}

# with_compressors NAME...: "NAME:COMPRESSOR" for each strategy, with its natural prompt compressor,
# from one registry call (each call imports torch: seconds).
with_compressors() {
    (($#)) || return 0
    local compressors
    compressors=$(registry compressor "$@") || return
    paste -d : <(printf '%s\n' "$@") <(printf '%s\n' "$compressors")
}

# sweep_done: exit 1 when any run failed.
sweep_done() {
    if ((SWEEP_FAILED)); then
        echo "$SWEEP_FAILED run(s) failed" >&2
        exit 1
    fi
}
