#!/usr/bin/env bash
# Every single-GPU check, in one go, against the wheel in .dist (make gpu-dist), installed into
# the Python environment that has torch:
#
#   TMS=<torch_memory_saver checkout>/test tests/gpu/one_gpu.sh [.dist]
#   PARTS="graph_stack torch_hooks" tests/gpu/one_gpu.sh [.dist]     # only some of them
#
# graph_stack.py (CUDA graphs while nccl is paused), real_model.py (FSDP2 + transformers RL
# loop, both hook modes), torch_hooks.py (tensors, graphs, compat in both hook modes),
# ipc_share.py (torch's CUDA tensor sharing of memsaver memory across a pause/resume),
# paused_alloc.py (a process keeps working while paused: no allocation on paused memory), tms_suite.sh and tms_public.py (torch_memory_saver's own tests). PARTS names the parts to run
# (default: all); a part left out is reported "NOT ASKED". A part that was asked for and cannot
# run (tms_* without TMS) fails, as does one that fails. Each log goes to $OUT or /tmp/one_gpu;
# exits non-zero if any part failed or did not run.
set -uo pipefail
DIST=${1:-.dist}
LOGS=${OUT:-/tmp/one_gpu}
ALL="graph_stack real_model torch_hooks ipc_share paused_alloc tms_suite tms_public"
PARTS=${PARTS:-$ALL}
for p in $PARTS; do
  [[ " $ALL " == *" $p "* ]] || { echo "FAIL one_gpu: unknown part '$p' in PARTS (parts: $ALL)"; exit 2; }
done
mkdir -p "$LOGS"
export NCCL_NVLS_ENABLE=0 MASTER_ADDR=127.0.0.1
python3 -m pip install -q --no-index --no-deps --force-reinstall "$DIST"/memsaver-*.whl || exit 2
preload=$(python3 -m memsaver preload-path) || exit 2
failed=() ran=() not_asked=()
run() {
  local name=$1; shift
  if [[ " $PARTS " != *" $name "* ]]; then
    echo "NOT ASKED $name"; not_asked+=("$name"); return
  fi
  local t0=$SECONDS
  ran+=("$name")
  if timeout 600 "$@" > "$LOGS/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - t0)) s)"
  else
    echo "FAIL $name ($((SECONDS - t0)) s): tail of $LOGS/$name.log"; tail -15 "$LOGS/$name.log"
    failed+=("$name")
  fi
}
# Asked for but impossible here: a failure, never a pass.
cannot() {
  if [[ " $PARTS " == *" $1 "* ]]; then
    echo "FAIL $1: asked for but cannot run: $2"; failed+=("$1")
  else
    echo "NOT ASKED $1"; not_asked+=("$1")
  fi
}
run graph_stack env LD_PRELOAD="$preload" MASTER_PORT=29611 python3 tests/gpu/graph_stack.py
run real_model python3 tests/gpu/real_model.py --out "$LOGS/real_model"
run torch_hooks python3 tests/gpu/torch_hooks.py
run ipc_share python3 tests/gpu/ipc_share.py
run paused_alloc python3 tests/gpu/paused_alloc.py
if [ -n "${TMS:-}" ]; then
  run tms_suite tests/gpu/tms_suite.sh "$DIST"
  run tms_public env MEMSAVER_TORCH_MEMORY_SAVER=1 python3 tests/gpu/tms_public.py
else
  why="set TMS to torch_memory_saver's test/ directory, or leave the part out of PARTS"
  cannot tms_suite "$why"
  cannot tms_public "$why"
fi
if [ ${#failed[@]} -eq 0 ]; then
  echo "PASS one_gpu (ran: ${ran[*]}${not_asked:+; not asked: ${not_asked[*]}})"
else
  echo "FAIL one_gpu: ${failed[*]}"; exit 1
fi
