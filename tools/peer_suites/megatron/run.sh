#!/usr/bin/env bash
# Megatron-LM's tests/unit_tests/dist_checkpointing (core_v0.16.1) on CPU, 8 gloo ranks under torchrun.
#   tools/peer_suites/megatron/run.sh ours|megatron [test ids or pytest args...]
# ours: Megatron-Core's save/load/load_tensors_metadata/load_common_state_dict/load_plain_tensors are
# lightning_distckpt's (ours.py); megatron: its own (the baseline). No args: the selected files below.
# Env: PEER_ROOT (extracted Megatron-LM tree, default /work/peer/megatron: see RESULTS.md for how),
# NPROC (8), PEER_OUT (results), PEER_CAST=any / PEER_SAFE_GLOBALS=mod:Name,... (ours' options),
# LDC_REV=HEAD: run a git archive of that commit's lightning_distckpt (the shared working tree may be
# mid-edit), with LDC_OVERLAY="path ..." (files of the working tree) copied over it.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
MODE=${1:-ours}; shift || true
PEER=${PEER_ROOT:-/work/peer/megatron}
NPROC=${NPROC:-8}
OUT=${PEER_OUT:-/tmp/peer_megatron_$MODE}
rm -rf "$OUT"; mkdir -p "$OUT"
CKPT=$(mktemp -d)
export PEER_PG_TIMEOUT=${PEER_PG_TIMEOUT:-60} PEER_MODE=$MODE PEER_OUT=$OUT PEER_CKPT_TMP=$CKPT OMP_NUM_THREADS=1
export PYTHONPATH=$HERE:$PEER${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${LDC_REV:-}" ]; then
    REPO=$(cd "$HERE/../../.." && pwd)
    mkdir -p "$OUT/src" && git -C "$REPO" archive "$LDC_REV" lightning_distckpt | tar -x -C "$OUT/src"
    for f in ${LDC_OVERLAY:-}; do cp "$REPO/$f" "$OUT/src/$f"; done
    export PYTHONPATH=$OUT/src:$PYTHONPATH  # before the editable install's finder
fi
D=tests/unit_tests/dist_checkpointing
# test_fully_parallel.py is left out: it drives Megatron-Core's strategy wrappers directly (never
# save/load), so nothing of ours runs, and on CPU some of its tests need CUDA on some ranks only.
SELECTED=($D/test_serialization.py $D/test_mapping.py $D/test_safe_globals.py $D/test_async_save.py
          $D/test_torch_dist.py $D/test_checkpointable.py)
# Left out: test_remove_sharded_tensors fails on rank 0 only with Megatron-Core's own save/load on this
# torch (the other ranks then wait in a barrier and every later test fails); the other two need CUDA.
DESELECTED=(--deselect $D/test_serialization.py::TestSerialization::test_remove_sharded_tensors
            --deselect $D/test_mapping.py::TestShardedTensor::test_from_rank_offsets_constructor
            --deselect $D/test_torch_dist.py::TestCPUTensors::test_cpu_tensors_dont_take_too_much_space)
# Megatron-Core's own async save hangs on CPU here (its async caller never finishes on some ranks);
# test_errors_are_reported injects a failure into Megatron-Core's file writer, which ours does not use.
if [ "$MODE" = megatron ]; then DESELECTED+=(--deselect $D/test_async_save.py); fi
DESELECTED+=(--deselect $D/test_async_save.py::TestAsyncSave::test_errors_are_reported)
[ $# -eq 0 ] && set -- "${SELECTED[@]}" "${DESELECTED[@]}"
PORT=$((20000 + RANDOM % 20000))
cd "$PEER"
timeout "${PEER_TIMEOUT:-3000}" python -m torch.distributed.run --nproc-per-node="$NPROC" --master-port="$PORT" \
    --log-dir "$OUT/logs" --redirects 3 -m pytest -c "$HERE/pytest.ini" --rootdir "$PEER" "$@"
rc=$?
python "$HERE/summarize.py" "$OUT"
rm -rf "$CKPT"
exit $rc
