#!/usr/bin/env bash
# GPU check of the allocator core on one real GPU (issue 2).
#
# 8 GiB with the cpu policy and 16 GiB with discard, 10 pause/resume cycles each; every cycle
# checks with cuMemGetInfo that pause gave the tag's memory back and that the cpu-policy
# contents are bit-exact after resume. Prints ms and GB/s per cycle and per policy; exits
# non-zero on any failed check. Then the staged demo on the GPU.
#
# Usage: tests/gpu/core_cycles.sh [DIR_WITH_memsaver_BINARY]   (default: target/release)
# Built binaries travel to a lent GPU machine with `make gpu-dist` (carry .dist).
set -euo pipefail
bin_dir=${1:-target/release}
memsaver="$bin_dir/memsaver"
[ -x "$memsaver" ] || { echo "no memsaver binary at $memsaver (run make build or make gpu-dist)" >&2; exit 2; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== large allocations (1 GiB each) =="
"$memsaver" bench --cpu-gib "${CPU_GIB:-8}" --discard-gib "${DISCARD_GIB:-16}" --cycles "${CYCLES:-10}" --chunk-mib 1024
echo "== many allocations (64 MiB each) =="
"$memsaver" bench --cpu-gib "${CPU_GIB:-8}" --discard-gib "${DISCARD_GIB:-16}" --cycles "${CYCLES:-10}" --chunk-mib 64
echo "== staged demo =="
"$memsaver" demo
echo "core_cycles: PASS"
