#!/usr/bin/env bash
# Issue 4's GPU check at full length, on a machine with N GPUs (default 2):
#   1. nccl_pause.py for CYCLES cycles (default 50) with the default backup (everything);
#   2. MEMSAVER_NCCL_BACKUP=headers with each NCCL protocol forced in turn (LL, LL128, Simple),
#      SHORT cycles each (default 20; 0 skips them): staging buffers come back as fresh memory, so every
#      protocol must cope with that;
#   3. MEMSAVER_NCCL_BACKUP=headers, CYCLES cycles, NCCL's own protocol choice;
#   4. other transports, SHORT cycles each: shared host memory (NCCL_P2P_DISABLE=1) and the
#      network transport over sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1), as between
#      nodes, with its proxy thread.
# Logs (with the hook's phase timings) go to LOGDIR (default ./nccl-cycles-logs). PRELOAD picks
# another libmemsaver.so (to compare builds on one machine).
# RUNS="name ..." runs only the named runs (backup-all headers-LL ... transport-net).
# Run after `. tests/gpu/setup_device.sh`. Exits non-zero if any run fails.
set -u
NPROC=${NPROC:-2} CYCLES=${CYCLES:-50} SHORT=${SHORT:-20} LOGDIR=${LOGDIR:-nccl-cycles-logs}
mkdir -p "$LOGDIR"
PRELOAD=${PRELOAD:-$(python3 -m memsaver preload-path)} || exit 1
here=$(dirname "$0")
status=0
run() { # name, cycles, env...
    local name=$1 cycles=$2; shift 2
    if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then return; fi
    echo "== $name ($cycles cycles; $*)"
    env "$@" LD_PRELOAD="$PRELOAD" MEMSAVER_LOG=memsaver_nccl_hook=info,memsaver_ipc=info \
        torchrun --nproc-per-node "$NPROC" "$here/nccl_pause.py" "$cycles" \
        >"$LOGDIR/$name.log" 2>&1
    local rc=$?
    grep -h "NCCL_PAUSE\|FAIL" "$LOGDIR/$name.log"
    [ $rc -eq 0 ] || { echo "$name: FAILED (rc $rc, see $LOGDIR/$name.log)"; status=1; }
}
run backup-all "$CYCLES" MEMSAVER_NCCL_BACKUP=all
if [ "$SHORT" -gt 0 ]; then
    for proto in LL LL128 Simple; do
        run "headers-$proto" "$SHORT" MEMSAVER_NCCL_BACKUP=headers NCCL_PROTO=$proto
    done
fi
run backup-headers "$CYCLES" MEMSAVER_NCCL_BACKUP=headers
if [ "$SHORT" -gt 0 ]; then
    run transport-shm "$SHORT" NCCL_P2P_DISABLE=1
    run transport-net "$SHORT" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
fi
[ $status -eq 0 ] && echo "nccl_cycles: PASS" || echo "nccl_cycles: FAIL"
exit $status
