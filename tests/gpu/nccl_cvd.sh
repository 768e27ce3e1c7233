#!/usr/bin/env bash
# nccl_pause.py with one process per GPU where each process sees only its own GPU
# (CUDA_VISIBLE_DEVICES=0 and =1, both as device 0): the importer maps memory of a device it
# cannot see. NCCL's chosen transport is logged (NCCL_DEBUG=INFO) to show it shares buffers
# between the processes (P2P over cuMem handles). Run after `. tests/gpu/setup_device.sh`.
# Exits non-zero if either process fails.
set -u
CYCLES=${CYCLES:-10} LOGDIR=${LOGDIR:-nccl-cvd-logs}
mkdir -p "$LOGDIR"
PRELOAD=${PRELOAD:-$(python3 -m memsaver preload-path)} || exit 1
here=$(dirname "$0")
pids=()
for r in 0 1; do
    CUDA_VISIBLE_DEVICES=$r RANK=$r LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=${MASTER_PORT:-29533} NCCL_DEBUG=INFO LD_PRELOAD="$PRELOAD" \
        python3 "$here/nccl_pause.py" "$CYCLES" >"$LOGDIR/rank$r.log" 2>&1 &
    pids+=($!)
done
status=0
for i in 0 1; do wait "${pids[$i]}" || { echo "rank $i failed (see $LOGDIR/rank$i.log)"; status=1; }; done
grep -h "NCCL_PAUSE" "$LOGDIR"/rank*.log
grep -h -m3 "via P2P\|via SHM\|via NET" "$LOGDIR"/rank0.log
[ $status -eq 0 ] && echo "nccl_cvd: PASS" || echo "nccl_cvd: FAIL"
exit $status
