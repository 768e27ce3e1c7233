#!/usr/bin/env bash
# Builds NCCL from a source tarball (default .nccl/nccl-2.30.7.tgz, from ../shared/third_party)
# for the H100 (sm_90) with only the kernels the GPU checks use (AllReduce of f32 sums, and
# SendRecv for all-to-all and send/recv): about a minute on 16 cores. Prints the path of the
# libnccl.so.2 it built on its last line; the build log is /tmp/nccl-build.log.
# Usage: tests/gpu/build_nccl.sh [TARBALL]
set -euo pipefail
tarball=${1:-.nccl/nccl-2.30.7.tgz}
work=/tmp/nccl-src
rm -rf "$work" && mkdir -p "$work" && tar xzf "$tarball" -C "$work"
src=$(dirname "$(find "$work" -maxdepth 3 -name makefiles -type d | head -1)")
make -C "$src" -j"$(nproc)" src.build NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" \
    ONLY_FUNCS="AllReduce Sum f32 * *|SendRecv" >/tmp/nccl-build.log 2>&1 \
    || { tail -20 /tmp/nccl-build.log >&2; exit 1; }
find "$src/build/lib" -name 'libnccl.so.2' | head -1
