#!/usr/bin/env bash
# NCCL's own ncclCommSuspend/ncclCommResume beside memsaver's pause and resume of `nccl`, on the
# same NCCL (2.30.7, built by build_nccl.sh from TARBALL, default .nccl/nccl-2.30.7.tgz), the
# same machine and the same run: `memsaver bench nccl` with and without --native, NPROC ranks
# (default 4), for each number of communicators in COMMS (default "1 3"), CYCLES cycles
# (default 3); then memsaver on torch's own NCCL for the same COMMS. Each run's NCCL_BENCH lines
# go to LOGDIR (default ./nccl-native-logs), a summary to stdout. Exits non-zero if a run fails.
# Usage (after `. tests/gpu/setup_device.sh`): tests/gpu/nccl_native.sh
set -u
NPROC=${NPROC:-4} COMMS=${COMMS:-"1 3"} CYCLES=${CYCLES:-3} LOGDIR=${LOGDIR:-nccl-native-logs}
TARBALL=${TARBALL:-.nccl/nccl-2.30.7.tgz}
here=$(dirname "$0")
mkdir -p "$LOGDIR"
lib=$("$here/build_nccl.sh" "$TARBALL" | tail -1) || { echo "nccl_native: FAIL (build)"; exit 1; }
echo "built $lib"
export NCCL_NVLS_ENABLE=0
status=0
run() { # name, LD_PRELOAD, flags...
    local name=$1 preload=$2; shift 2
    echo "== $name"
    LD_PRELOAD=$preload python3 -m memsaver bench nccl --ranks "$NPROC" --cycles "$CYCLES" "$@" \
        >"$LOGDIR/$name.log" 2>&1 || { echo "$name: FAILED (see $LOGDIR/$name.log)"; status=1; }
    python3 - "$LOGDIR/$name.log" <<'PY'
import json, statistics, sys
rows = [json.loads(l.split(" ", 1)[1]) for l in open(sys.argv[1]) if l.startswith("NCCL_BENCH ")]
for r in rows[:1]:
    later = lambda xs: xs[1:] or xs
    print(f"  {r['mode']}, {r['comms']} comms: pause first {r['pause_ms'][0]:.0f} ms, then median "
          f"{statistics.median(later(r['pause_ms'])):.0f} ms; resume first {r['resume_ms'][0]:.0f} ms, "
          f"then median {statistics.median(later(r['resume_ms'])):.0f} ms; calls {r['calls_per_pause']}"
          f"/{r['calls_per_resume']}; freed {r['freed_pct']}% (rank 0 of {len(rows)})")
PY
}
for c in $COMMS; do
    run "native-2.30.7-c$c" "$lib" --comms "$c" --native
    run "memsaver-2.30.7-c$c" "$lib" --comms "$c"
done
for c in $COMMS; do
    run "memsaver-stock-c$c" "" --comms "$c"
done
[ $status -eq 0 ] && echo "nccl_native: PASS" || echo "nccl_native: FAIL"
exit $status
