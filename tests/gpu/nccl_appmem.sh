#!/usr/bin/env bash
# Memory from ncclMemAlloc under memsaver (tests/gpu/nccl_appmem.py), NPROC ranks (default 2,
# one per GPU; 1 checks the owner's side alone on one GPU): on torch's own NCCL, then on NCCL
# 2.30.7 built from source (carried as .nccl/nccl-2.30.7.tgz, built by build_nccl.sh) unless
# SKIP_230=1. On 2.30.7 torch 2.11's NCCL symmetric memory fails to set up without memsaver too
# (ncclDevCommCreate: invalid usage), so that part is reported there, not checked.
# Usage (after `. tests/gpu/setup_device.sh`): [NPROC=2] tests/gpu/nccl_appmem.sh [CYCLES]
set -euo pipefail
cycles=${1:-3}
here=$(dirname "$0")
preload=$(python3 -m memsaver preload-path)
echo "== torch's NCCL"
LD_PRELOAD="$preload" NCCL_NVLS_ENABLE=0 timeout 300 \
    python3 -m torch.distributed.run --nproc-per-node "${NPROC:-2}" "$here/nccl_appmem.py" "$cycles"
if [ "${SKIP_230:-0}" != 1 ]; then
    lib=$("$here/build_nccl.sh" | tail -1)
    echo "== NCCL 2.30.7 ($lib)"
    LD_PRELOAD="$preload $lib" NCCL_NVLS_ENABLE=0 timeout 300 \
        python3 -m torch.distributed.run --nproc-per-node "${NPROC:-2}" "$here/nccl_appmem.py" \
        "$cycles" --symm-optional
fi
