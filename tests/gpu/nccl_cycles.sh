#!/usr/bin/env bash
# pause('nccl') at full length, on a machine with N GPUs (default 2), nccl_pause.py throughout
# (every collective on three communicators, and a CUDA graph of NCCL all_reduces replayed after
# each resume):
#   1. backup-cpu: CYCLES cycles (default 50) with the default backup (every byte);
#   2. the headers backup (MEMSAVER_NCCL_BACKUP=headers: staging buffers come back zeroed,
#      as NCCL allocated them, so every protocol and transport must cope with that), CYCLES cycles each:
#      headers-LL, headers-LL128, headers-Simple (each protocol forced in turn), headers (NCCL's
#      own choice), headers-shm (shared host memory: NCCL_P2P_DISABLE=1) and headers-net (the
#      network transport over sockets, as between nodes, with its proxy thread:
#      NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1);
#   3. cpu-shm and cpu-net: the other transports with the default backup, SHORT cycles each
#      (default 20; 0 skips them).
# Logs (with the hook's phase timings) go to LOGDIR (default ./nccl-cycles-logs). PRELOAD picks
# another libmemsaver.so (to compare builds on one machine).
# RUNS="name ..." runs only the named runs (backup-cpu headers-LL ... cpu-net).
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
    if [ "$cycles" -le 0 ]; then return; fi
    echo "== $name ($cycles cycles; $*)"
    env "$@" LD_PRELOAD="$PRELOAD" MEMSAVER_LOG=memsaver_nccl_hook=info,memsaver_ipc=info \
        timeout $((120 + 4 * cycles)) torchrun --nproc-per-node "$NPROC" "$here/nccl_pause.py" "$cycles" \
        >"$LOGDIR/$name.log" 2>&1
    local rc=$?
    grep -h "NCCL_PAUSE\|FAIL" "$LOGDIR/$name.log"
    [ $rc -eq 0 ] || { echo "$name: FAILED (rc $rc, see $LOGDIR/$name.log)"; status=1; }
}
shm=(NCCL_P2P_DISABLE=1) net=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
run backup-cpu "$CYCLES" MEMSAVER_NCCL_BACKUP=cpu
for proto in LL LL128 Simple; do
    run "headers-$proto" "$CYCLES" MEMSAVER_NCCL_BACKUP=headers NCCL_PROTO=$proto
done
run headers "$CYCLES" MEMSAVER_NCCL_BACKUP=headers
run headers-shm "$CYCLES" MEMSAVER_NCCL_BACKUP=headers "${shm[@]}"
run headers-net "$CYCLES" MEMSAVER_NCCL_BACKUP=headers "${net[@]}"
run cpu-shm "$SHORT" MEMSAVER_NCCL_BACKUP=cpu "${shm[@]}"
run cpu-net "$SHORT" MEMSAVER_NCCL_BACKUP=cpu "${net[@]}"
[ $status -eq 0 ] && echo "nccl_cycles: PASS" || echo "nccl_cycles: FAIL"
exit $status
