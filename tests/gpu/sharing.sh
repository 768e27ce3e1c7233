#!/usr/bin/env bash
# Every GPU check of memory shared between processes, on one machine with N GPUs (NPROC,
# default 4; at least 2): CUDA IPC of tagged tensors (ipc_share.py, both modes, 1 GPU), NCCL's
# registration of tagged tensors (nccl_register.py: explicit ncclCommRegister, --resume-first,
# --torch-hook with torch's allocator hook; 2 ranks) and the `nccl` tag's pause and resume
# (nccl_pause.py at 2 ranks and at NPROC ranks), each under a timeout. Logs go to LOGDIR
# (default ./sharing-logs); CYCLES (default 3) cycles each. Run after
# `. tests/gpu/setup_device.sh`. Exits non-zero if any check fails.
set -u
NPROC=${NPROC:-4} CYCLES=${CYCLES:-3} LOGDIR=${LOGDIR:-sharing-logs}
mkdir -p "$LOGDIR"
PRELOAD=$(python3 -m memsaver preload-path) || exit 1
export NCCL_NVLS_ENABLE=0
here=$(dirname "$0")
status=0
check() { # name, timeout in s, command...
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    timeout "$limit" env LD_PRELOAD="$PRELOAD" "$@" >"$LOGDIR/$name.log" 2>&1
    local rc=$?
    grep -h "PASS\|FAIL\|NCCL_PAUSE\|median\|freed" "$LOGDIR/$name.log" | tail -n 20
    if [ $rc -ne 0 ]; then
        echo "$name: FAILED (rc $rc, see $LOGDIR/$name.log)"
        status=1
    fi
}
check ipc_share 300 python3 "$here/ipc_share.py"
check nccl_register 240 torchrun --nproc-per-node 2 "$here/nccl_register.py" "$CYCLES"
check nccl_register-resume-first 240 \
    torchrun --nproc-per-node 2 "$here/nccl_register.py" "$CYCLES" --resume-first
check nccl_register-torch-hook 240 env TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 \
    torchrun --nproc-per-node 2 "$here/nccl_register.py" "$CYCLES" --torch-hook
check nccl_pause-2 300 torchrun --nproc-per-node 2 "$here/nccl_pause.py" "$CYCLES"
if [ "$NPROC" -gt 2 ]; then
    check "nccl_pause-$NPROC" 300 torchrun --nproc-per-node "$NPROC" "$here/nccl_pause.py" "$CYCLES"
fi
[ $status -eq 0 ] && echo "sharing.sh: every check PASSED" || echo "sharing.sh: FAILED"
exit $status
