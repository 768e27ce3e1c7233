#!/usr/bin/env bash
# Every single-GPU check, in one go, against the wheel in .dist (make gpu-dist), installed into
# the Python environment that has torch:
#
#   TMS=<torch_memory_saver checkout>/test tests/gpu/one_gpu.sh [.dist]
#
# graph_stack.py (CUDA graphs while nccl is paused), real_model.py (FSDP2 + transformers RL
# loop, both hook modes), torch_hooks.py (tensors, graphs, compat in both hook modes),
# tms_suite.sh and tms_public.py (torch_memory_saver's own tests). Each log goes to $OUT or
# /tmp/one_gpu; exits non-zero if any check failed.
set -uo pipefail
DIST=${1:-.dist}
LOGS=${OUT:-/tmp/one_gpu}
mkdir -p "$LOGS"
export NCCL_NVLS_ENABLE=0 MASTER_ADDR=127.0.0.1
python3 -m pip install -q --no-index --no-deps --force-reinstall "$DIST"/memsaver-*.whl || exit 2
preload=$(python3 -m memsaver preload-path) || exit 2
failed=()
run() {
  local name=$1; shift
  local t0=$SECONDS
  if timeout 600 "$@" > "$LOGS/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - t0)) s)"
  else
    echo "FAIL $name ($((SECONDS - t0)) s): tail of $LOGS/$name.log"; tail -15 "$LOGS/$name.log"
    failed+=("$name")
  fi
}
run graph_stack env LD_PRELOAD="$preload" MASTER_PORT=29611 python3 tests/gpu/graph_stack.py
run real_model python3 tests/gpu/real_model.py --out "$LOGS/real_model"
run torch_hooks python3 tests/gpu/torch_hooks.py
if [ -n "${TMS:-}" ]; then
  run tms_suite tests/gpu/tms_suite.sh "$DIST"
  run tms_public env MEMSAVER_TORCH_MEMORY_SAVER=1 python3 tests/gpu/tms_public.py
else
  echo "SKIP tms_suite, tms_public: set TMS to torch_memory_saver's test/ directory"
fi
[ ${#failed[@]} -eq 0 ] && echo "PASS one_gpu" || { echo "FAIL one_gpu: ${failed[*]}"; exit 1; }
