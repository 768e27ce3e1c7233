#!/usr/bin/env bash
# The NCCL hook on NCCL 2.30.7 (built from the source in ../shared/third_party, carried as
# .nccl/nccl-2.30.7.tgz), 2 GPUs: builds libnccl.so.2 (AllReduce/SendRecv kernels only, about a
# minute), then runs nccl_pause.py with torch on top of it, under the preload.
# Usage (on the 2-GPU machine, after `. tests/gpu/setup_device.sh`): tests/gpu/nccl_230.sh [CYCLES]
set -euo pipefail
cycles=${1:-5}
work=/tmp/nccl230
mkdir -p "$work" && tar xzf .nccl/nccl-2.30.7.tgz -C "$work"
src=$(dirname "$(find "$work" -maxdepth 3 -name makefiles -type d | head -1)")
make -C "$src" -j32 src.build NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" \
    ONLY_FUNCS="AllReduce Sum f32 * *|SendRecv" >/tmp/nccl230-build.log 2>&1 \
    || { tail -20 /tmp/nccl230-build.log; exit 1; }
lib=$(find "$src/build/lib" -name 'libnccl.so.2' | head -1)
echo "built $lib"
LD_PRELOAD="$(python3 -m memsaver preload-path) $lib" NCCL_NVLS_ENABLE=0 \
    python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/nccl_230_check.py "$cycles"
