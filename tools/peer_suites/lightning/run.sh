#!/usr/bin/env bash
# Run Lightning's own checkpointing tests against lightning_distckpt, one mode at a time (see
# ldc_harness.py), plus stock Lightning as the baseline, and count the results (summarize.py).
#
#   tools/peer_suites/lightning/run.sh [MODE ...]      # default: every mode
#   SUITE=resume tools/peer_suites/lightning/run.sh stock plugin strategy   # the resume / restore tests
#
# PEER: Lightning's tests/ extracted from its repository at the tag matching the installed version
#   (default /work/peer/lightning/tests; see RESULTS.md for how it was made), outside this repo.
# PEER_SITE: extra packages those tests import (cloudpickle, tensorboardX), e.g. installed with
#   `pip install --target "$PEER_SITE" cloudpickle tensorboardX` (not in our environment).
# TESTS: the test paths under $PEER (default: the checkpointing tests and the checkpoint-IO plugins').
# READTHROUGH=1 also routes single-file reads of our directories to our loader (ldc_harness.py).
# LDC_REV=HEAD: run a git archive of that commit's lightning_distckpt (the shared working tree may be
#   mid-edit), with LDC_OVERLAY="path ..." (files of the working tree) copied over it.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PEER="${PEER:-/work/peer/lightning/tests}"
PEER_SITE="${PEER_SITE:-/work/peer/lightning/site}"
OUT="${OUT:-$PEER/../results}"
# test_fabric.py: its save / load tests only (the others are not about checkpoints; several pretend a
# 2-process launch with no processes, which a strategy building process groups cannot follow).
FABRIC_SAVE_LOAD="$(printf 'tests_fabric/test_fabric.py::%s ' test_save_wrapped_objects test_save_filter \
  test_load_wrapped_objects test_load_raw test_fabric_load_accepts_weights_only_false \
  test_fabric_load_forwards_weights_only_to_strategy test_fabric_load_raw_forwards_weights_only_to_strategy)"
# SUITE=resume: Lightning's resume and restore tests instead (models/test_restore.py, the checkpoint
# connector's, the callbacks' that save and resume, Fabric's utilities/test_load.py); their result files
# are named resume_<mode>, beside the checkpointing suite's.
CALLBACKS="$(printf 'tests_pytorch/callbacks/test_%s.py ' callbacks early_stopping finetuning_callback lambda_function \
  model_checkpoint_additional_cases model_checkpoint_edge_cases model_checkpoint_manual_opt \
  model_checkpoint_step_interval_val_metric pruning stochastic_weight_avg timer weight_averaging)"
RESUME_TESTS="tests_pytorch/models/test_restore.py tests_pytorch/trainer/connectors/test_checkpoint_connector.py \
$CALLBACKS tests_fabric/utilities/test_load.py"
# SUITE=model_parallel: Lightning's ModelParallelStrategy tests (Trainer's and Fabric's, unit and integration)
# against our subclasses; modes stock (baseline) and model_parallel; result files model_parallel_<mode>.
MP_TESTS="$(printf 'tests_%s/strategies/test_model_parallel%s.py ' pytorch '' pytorch _integration fabric '' \
  fabric _integration)"
SUITE="${SUITE:-checkpointing}"
case "$SUITE" in
  checkpointing) PREFIX="" ;;
  resume) PREFIX="resume_"; TESTS="${TESTS:-$RESUME_TESTS}" ;;
  model_parallel) PREFIX="model_parallel_"; TESTS="${TESTS:-$MP_TESTS}" ;;
  *) echo "SUITE=$SUITE: checkpointing, resume or model_parallel" >&2; exit 2 ;;
esac
TESTS="${TESTS:-tests_pytorch/checkpointing tests_pytorch/plugins/test_checkpoint_io_plugin.py tests_pytorch/plugins/test_async_checkpoint.py tests_fabric/strategies/test_strategy.py tests_fabric/strategies/test_single_device.py tests_fabric/strategies/test_ddp.py tests_fabric/strategies/test_ddp_integration.py $FABRIC_SAVE_LOAD}"
MODES=("$@")
if [ ${#MODES[@]} -eq 0 ]; then
  if [ "$SUITE" = model_parallel ]; then MODES=(stock model_parallel)
  else MODES=(stock plugin async lightning_async stock_async strategy strategy_async); fi
fi
mkdir -p "$OUT"
RAN=()
if [ -n "${LDC_REV:-}" ]; then
  REPO="$(cd "$HERE/../../.." && pwd)"
  SRC="$OUT/src"; rm -rf "$SRC"; mkdir -p "$SRC"
  git -C "$REPO" archive "$LDC_REV" lightning_distckpt | tar -x -C "$SRC"
  for f in ${LDC_OVERLAY:-}; do cp "$REPO/$f" "$SRC/$f"; done
  export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"  # before the editable install's finder
  echo "lightning_distckpt from $LDC_REV ($(git -C "$REPO" rev-parse --short "$LDC_REV"))"
fi
cd "$PEER"
for mode in "${MODES[@]}"; do
  tag="$PREFIX$mode$([ "${READTHROUGH:-0}" = 1 ] && echo _readthrough || true)"
  echo "== $tag"
  # shellcheck disable=SC2086
  LDC_PEER_MODE="$mode" LDC_PEER_READTHROUGH="${READTHROUGH:-0}" LDC_PEER_RESULTS="$OUT/$tag.jsonl" \
  PYTHONPATH="$HERE:$PEER:$PEER_SITE${PYTHONPATH:+:$PYTHONPATH}" \
    python -m pytest -c "$HERE/pytest.ini" --rootdir "$PEER" -p ldc_harness -q --tb=line $TESTS \
    > "$OUT/$tag.log" 2>&1 || true
  tail -1 "$OUT/$tag.log"
  RAN+=("$OUT/$tag.jsonl")
done
python "$HERE/summarize.py" "${RAN[@]}"  # this run's modes only
