#!/usr/bin/env bash
# What a `nccl` pause and resume copy and how long they take as communicators grow, with packed
# backups (the default) and, at the largest count, with whole copies (MEMSAVER_PACK=off) in the
# same run: `memsaver bench nccl` on torch's NCCL, NPROC ranks (default 2), for each count in
# COMMS (default "1 4 16"), CYCLES cycles (default 5). Each run's NCCL_BENCH lines and the
# ranks' pause/resume breakdown (MEMSAVER_LOG info lines) go to LOGDIR (default
# ./nccl-pack-logs); a summary to stdout. Exits non-zero if a run fails.
# Usage (after `. tests/gpu/setup_device.sh`): tests/gpu/nccl_pack.sh
set -u
NPROC=${NPROC:-2} COMMS=${COMMS:-"1 4 16"} CYCLES=${CYCLES:-5} LOGDIR=${LOGDIR:-nccl-pack-logs}
mkdir -p "$LOGDIR"
export NCCL_NVLS_ENABLE=0
status=0
run() { # name, extra environment..., -- flags...
    local name=$1; shift
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    echo "== $name"
    env "${envs[@]}" MEMSAVER_LOG=memsaver_nccl_hook=info,warn \
        python3 -m memsaver bench nccl --ranks "$NPROC" --cycles "$CYCLES" "$@" \
        >"$LOGDIR/$name.log" 2>&1 || { echo "$name: FAILED (see $LOGDIR/$name.log)"; status=1; }
    python3 - "$LOGDIR/$name.log" <<'PY'
import json, re, statistics, sys
lines = open(sys.argv[1]).read().splitlines()
rows = [json.loads(l.split(" ", 1)[1]) for l in lines if l.startswith("NCCL_BENCH ")]
later = lambda xs: xs[1:] or xs
for r in rows:
    print(f"  rank {r['rank']}, {r['comms']} comms: pause first {r['pause_ms'][0]:.1f} ms, median "
          f"{statistics.median(later(r['pause_ms'])):.1f} ms; resume first {r['resume_ms'][0]:.1f} ms, "
          f"median {statistics.median(later(r['resume_ms'])):.1f} ms; copied {r['bytes_copied_per_pause']}"
          f"/{r['bytes_copied_per_resume']} B; calls {r['calls_per_pause']}/{r['calls_per_resume']}; "
          f"freed {r['freed_pct']}%")
keys = ("restore_local_ms", "create_map_ms", "queue_copies_ms", "wait_copies_ms", "fetch_wait_ms", "map_imports_ms",
        "restore_stack_ms")
got = {k: [] for k in keys}
for l in lines:
    if "nccl resume" in l and "restore_local_ms" in l:
        for k in keys:
            m = re.search(rf"{k}=([0-9.]+)", l)
            if m:
                got[k].append(float(m.group(1)))
if got["restore_local_ms"]:
    print("  resume breakdown, median over ranks and later cycles (ms): " + ", ".join(
        f"{k.removesuffix('_ms')} {statistics.median(later(v)):.2f}" for k, v in got.items() if v))
PY
}
for c in $COMMS; do
    run "pack-c$c" -- --comms "$c"
done
last=${COMMS##* }
run "whole-c$last" MEMSAVER_PACK=off -- --comms "$last"
[ $status -eq 0 ] && echo "nccl_pack: PASS" || echo "nccl_pack: FAIL"
exit $status
