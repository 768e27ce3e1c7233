#!/usr/bin/env bash
# What chunks (MEMSAVER_NCCL_CHUNK_MB) do to the first pause of `nccl`, with and without them in
# the same run: `memsaver bench nccl` for each count in COMMS (default "1 16"), CYCLES cycles
# (default 3), CHUNK MiB chunks (default 64) against none.
# - With NPROC GPUs (default 2) visible: torch's NCCL, one rank per GPU, then
#   tests/gpu/nccl_cycles.sh with chunks (every collective and a CUDA graph exact after each
#   resume; CYCLES_EACH cycles per run, default 10; RUNS as nccl_cycles.sh takes it).
# - With fewer: two ranks on GPU 0 running the fake NCCL on this driver (`--fake-nccl`, real
#   NCCL's count of buffers: --buffers 320; MEMSAVER_FAKE_NCCL_LIB, default
#   .dist/fake-nccl/libnccl.so.2 from `make gpu-dist`), then with MEMSAVER_NCCL_BACKUP=cpu
#   (every byte checked) and with imports that join a chunk (--mib 2 --buffers 2).
# Each run's log goes to LOGDIR (default ./nccl-chunks-logs), a summary to stdout. Exits
# non-zero if a run fails (a rank, a check of the contents) or if chunks do not lower the
# driver calls of the first pause; the times are printed, not judged.
# Usage (after `. tests/gpu/setup_device.sh`): tests/gpu/nccl_chunks.sh
set -u
NPROC=${NPROC:-2} COMMS=${COMMS:-"1 16"} CYCLES=${CYCLES:-3} CHUNK=${CHUNK:-64}
LOGDIR=${LOGDIR:-nccl-chunks-logs}
mkdir -p "$LOGDIR"
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$gpus" -ge "$NPROC" ]; then
    mode=(--ranks "$NPROC")
else
    export MEMSAVER_FAKE_NCCL_LIB=${MEMSAVER_FAKE_NCCL_LIB:-$PWD/.dist/fake-nccl/libnccl.so.2}
    mode=(--fake-nccl --ranks 2)
    echo "$gpus GPU(s) visible: two ranks on GPU 0 with the fake NCCL ($MEMSAVER_FAKE_NCCL_LIB)"
fi
status=0
run() { # name, extra environment..., -- flags...
    local name=$1; shift
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    env "${envs[@]}" MEMSAVER_LOG=memsaver_nccl_hook=info,warn \
        python3 -m memsaver bench nccl "${mode[@]}" --cycles "$CYCLES" "$@" \
        >"$LOGDIR/$name.log" 2>&1 || { echo "$name: FAILED (see $LOGDIR/$name.log)"; status=1; }
    python3 - "$name" "$LOGDIR/$name.log" <<'PY'
import json, statistics, sys
rows = [json.loads(l.split(" ", 1)[1]) for l in open(sys.argv[2]) if l.startswith("NCCL_BENCH ")]
for r in rows:
    later = r["pause_ms"][1:] or r["pause_ms"]
    print(f"{sys.argv[1]}: rank {r['rank']}: first pause {r['pause_ms'][0]:.1f} ms "
          f"({r['calls_first_pause']} VMM calls), later {statistics.median(later):.1f} ms "
          f"({r['calls_per_pause']}); resume median {statistics.median(r['resume_ms']):.1f} ms; "
          f"freed {r['freed_pct']}%")
PY
}
first_calls() { # log -> the largest calls_first_pause of its ranks
    python3 -c 'import json, sys
rows = [json.loads(l.split(" ", 1)[1]) for l in open(sys.argv[1]) if l.startswith("NCCL_BENCH ")]
print(max((r["calls_first_pause"] for r in rows), default=-1))' "$1"
}
extra=()
[ "${mode[0]}" = --fake-nccl ] && extra=(--buffers 320)
for c in $COMMS; do
    run "plain-c$c" MEMSAVER_NCCL_CHUNK_MB=0 -- --comms "$c" "${extra[@]}"
    run "chunks-c$c" MEMSAVER_NCCL_CHUNK_MB="$CHUNK" -- --comms "$c" "${extra[@]}"
    plain=$(first_calls "$LOGDIR/plain-c$c.log") chunked=$(first_calls "$LOGDIR/chunks-c$c.log")
    if [ "$chunked" -lt 0 ] || [ "$plain" -lt 0 ] || [ "$chunked" -ge "$plain" ]; then
        echo "chunks-c$c: the first pause made $chunked VMM calls with chunks, $plain without"
        status=1
    fi
done
if [ "${mode[0]}" = --fake-nccl ]; then
    run "chunks-cpu-c4" MEMSAVER_NCCL_CHUNK_MB="$CHUNK" MEMSAVER_NCCL_BACKUP=cpu -- --comms 4 --buffers 320
    run "chunks-joins" MEMSAVER_NCCL_CHUNK_MB="$CHUNK" MEMSAVER_NCCL_BACKUP=cpu -- --comms 16 --mib 2 --buffers 2
else
    MEMSAVER_NCCL_CHUNK_MB="$CHUNK" LOGDIR="$LOGDIR/cycles" CYCLES=${CYCLES_EACH:-10} \
        SHORT=${CYCLES_EACH:-10} "$(dirname "$0")/nccl_cycles.sh" \
        || { echo "nccl_cycles with chunks: FAILED"; status=1; }
fi
[ $status -eq 0 ] && echo "nccl_chunks: PASS" || echo "nccl_chunks: FAIL"
exit $status
