#!/usr/bin/env bash
# The NCCL hook on NCCL 2.30.7 (built from the source in ../shared/third_party, carried as
# .nccl/nccl-2.30.7.tgz, by build_nccl.sh), 2 GPUs: runs nccl_pause.py with torch on top of it,
# under the preload.
# Usage (on the 2-GPU machine, after `. tests/gpu/setup_device.sh`): tests/gpu/nccl_230.sh [CYCLES]
set -euo pipefail
cycles=${1:-5}
here=$(dirname "$0")
lib=$("$here/build_nccl.sh" | tail -1)
echo "built $lib"
LD_PRELOAD="$(python3 -m memsaver preload-path) $lib" NCCL_NVLS_ENABLE=0 \
    python3 -m torch.distributed.run --nproc-per-node 2 "$here/nccl_230_check.py" "$cycles"
