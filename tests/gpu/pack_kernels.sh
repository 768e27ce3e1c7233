#!/usr/bin/env bash
# The packing kernels on a GPU: the committed PTX is what allocator/kernels/regenerate.sh makes
# of pack.cu with this machine's nvcc (skipped, and said, where there is no nvcc), and it packs
# and unpacks exactly (pack_kernels.py). Run from the repository root. Exits non-zero on failure.
set -euo pipefail
ptx=allocator/kernels/pack.ptx
if command -v nvcc >/dev/null; then
    fresh=$(mktemp)
    allocator/kernels/regenerate.sh > "$fresh"
    if [[ -n "${PTX_OUT:-}" ]]; then cp "$fresh" "$PTX_OUT"; fi
    if [[ ! -f $ptx ]] || ! diff -u <(tail -n +2 "$ptx") <(tail -n +2 "$fresh"); then
        echo "FAIL: $ptx is not what regenerate.sh makes of pack.cu; run it and commit the output"
        [[ -f $ptx ]] || ptx=$fresh
        [[ -n "${CHECK_FRESH:-}" ]] && ptx=$fresh && python3 tests/gpu/pack_kernels.py --ptx "$ptx"
        exit 1
    fi
    echo "ok: $ptx matches pack.cu ($(head -1 "$fresh"))"
else
    echo "NOT CHECKED: no nvcc here, so the PTX is not compared with pack.cu"
fi
python3 tests/gpu/pack_kernels.py --ptx "$ptx"
