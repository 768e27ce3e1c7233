#!/usr/bin/env bash
# Regenerates pack.ptx from pack.cu (needs nvcc; run on a GPU machine: the device README says
# how). The PTX targets sm_75 and declares PTX ISA 7.0, so that drivers from CUDA 11.0 on load
# it; the kernels use nothing newer. Prints the PTX on stdout:
#   allocator/kernels/regenerate.sh > allocator/kernels/pack.ptx
# tests/gpu/pack_kernels.sh checks that the committed file is what this prints.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nvcc -ptx -arch=compute_75 -O3 -o "$tmp/pack.ptx" "$here/pack.cu"
echo "// Generated from pack.cu by regenerate.sh ($(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p')); do not edit."
sed -e 's/^\.version .*/.version 7.0/' -e '/^\/\/ Cuda compilation tools/d' -e '/^\/\/ Based on/d' -e '/^\/\/ Compiler Build ID/d' "$tmp/pack.ptx"
