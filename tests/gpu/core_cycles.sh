#!/usr/bin/env bash
# GPU check of the allocator core on one real GPU (issue 2).
#
# 8 GiB with the cpu policy and 16 GiB with discard, 10 pause/resume cycles each; every cycle
# checks with cuMemGetInfo that pause gave the tag's memory back and that the cpu-policy
# contents are bit-exact after resume. Prints ms and GB/s per cycle and per policy; exits
# non-zero on any failed check. Then the staged demo on the GPU.
#
# Usage: tests/gpu/core_cycles.sh   (runs the `memsaver` command: MEMSAVER="python3 -m memsaver"
# by default, so the wheel must be importable: `make python` here, or on a lent GPU machine
# `make gpu-dist`, carry .dist and `. tests/gpu/setup_device.sh`)
set -euo pipefail
read -r -a memsaver <<< "${MEMSAVER:-python3 -m memsaver}"
"${memsaver[@]}" --version >/dev/null || { echo "no memsaver command (${memsaver[*]}): install the wheel (make python / make gpu-dist)" >&2; exit 2; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== large allocations (1 GiB each) =="
"${memsaver[@]}" bench --cpu-gib "${CPU_GIB:-8}" --discard-gib "${DISCARD_GIB:-16}" --cycles "${CYCLES:-10}" --chunk-mib 1024
echo "== many allocations (64 MiB each) =="
"${memsaver[@]}" bench --cpu-gib "${CPU_GIB:-8}" --discard-gib "${DISCARD_GIB:-16}" --cycles "${CYCLES:-10}" --chunk-mib 64
echo "== staged demo =="
"${memsaver[@]}" demo
echo "core_cycles: PASS"
