#!/usr/bin/env python3
"""GPU check: pausing `nccl` never lowers the kernel stack limit below what a CUDA graph or the
application needs (a graph instantiated at stack limit S dies with "unspecified launch failure"
(719), and the context with it, once the limit is below S), and frees the stack's local memory
when nothing needs it. One GPU, one process, a world-size-1 NCCL group, under the preload:

    LD_PRELOAD=$(python3 -m memsaver preload-path) NCCL_NVLS_ENABLE=0 \\
        python3 tests/gpu/graph_stack.py

1. graph: all_reduce; the application raises the stack limit to 1744 (what NCCL's kernels make
   the driver do with 2+ ranks) with cudaDeviceSetLimit; a CUDA graph is captured and replayed;
   pause("nccl"); the graph replays correctly while paused; nccl_stats() says the stack was
   kept and why; resume; all_reduce and replay correct.
2. destroyed: the graph is destroyed (del, gc, synchronize); the limit the application set
   still holds the stack (reason changes to the application's limit); figures printed.
3. freed (a child process; its kernel is built with nvcc): no graph and no limit set by the
   application; a kernel with a large stack frame makes the driver grow the limit, as NCCL's
   do; pause lowers it to 1024 and frees the local memory; resume restores it.

Every pause must free (cudaMemGetInfo) at least 90% of the device memory the hook says NCCL
owns, plus the stack memory it says it freed by lowering the limit (nccl_floor.py). Without
nvcc the third case cannot run: that is a failure, unless `--skip-freed-case` says to leave it
out (it is then reported "SKIP ... (asked)").

Prints PASS/FAIL lines; exits non-zero on any failure.
"""
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile

import memsaver
import torch
import torch.distributed as dist
from nccl_floor import PauseCheck

MIB = 1 << 20
CUDA_LIMIT_STACK_SIZE = 0
RAISED = 1744
FAILED = []


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)
    return ok


def cudart():
    """The CUDA runtime torch loaded (found in /proc/self/maps once CUDA is initialised)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("libcudart is not loaded")
    return ctypes.CDLL(sorted(paths)[0])


def stack_limit(rt):
    v = ctypes.c_size_t()
    rc = rt.cudaDeviceGetLimit(ctypes.byref(v), CUDA_LIMIT_STACK_SIZE)
    if rc != 0:
        raise RuntimeError(f"cudaDeviceGetLimit: {rc}")
    return v.value


def set_stack_limit(rt, value):
    rc = rt.cudaDeviceSetLimit(CUDA_LIMIT_STACK_SIZE, ctypes.c_size_t(value))
    if rc != 0:
        raise RuntimeError(f"cudaDeviceSetLimit: {rc}")


def init_nccl():
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531", "RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))


def all_reduce_ok(step):
    x = torch.full((1 << 20,), float(step), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    return bool(torch.all(x == step).item())


def pause_checked(label):
    """pause("nccl"), checked against the floor of nccl_floor.py: (bytes freed, nccl_stats())."""
    torch.cuda.synchronize()
    pc = PauseCheck()
    free0 = torch.cuda.mem_get_info()[0]
    pc.before(memsaver.nccl_stats())
    memsaver.pause("nccl")
    freed = torch.cuda.mem_get_info()[0] - free0
    st = memsaver.nccl_stats()
    pc.paused(freed, st)
    r = pc.report()
    check(f"{label}: pause frees NCCL's memory", not pc.failures(),
          "; ".join(pc.failures()) or f"{r['freed_by_pause_mib_min']} MiB, "
          f"{r['freed_pct_of_expected_min']}% of the {r['releasable_mib_max']} MiB NCCL owns "
          "plus the stack lowered")
    return freed, st


def show(label, stats, freed=None):
    extra = f", cudaMemGetInfo freed {freed / MIB:.1f} MiB" if freed is not None else ""
    print(f"  {label}: stack lowered {stats.get('stack_lowered_bytes', 0) / MIB:.1f} MiB, "
          f"kept {stats.get('stack_kept_bytes', 0) / MIB:.1f} MiB "
          f"({stats.get('stack_kept_reason')}){extra}", flush=True)


def graph_cases():
    init_nccl()
    rt = cudart()
    check("all_reduce before", all_reduce_ok(1))
    print(f"  stack limit after all_reduce (1 rank): {stack_limit(rt)} B/thread")
    set_stack_limit(rt, RAISED)
    check("limit raised", stack_limit(rt) == RAISED, f"{stack_limit(rt)}")

    a = torch.randn(1024, 1024, device="cuda")
    out = torch.empty_like(a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            out.copy_(a @ a + 1)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(a @ a + 1)
    g.replay()
    torch.cuda.synchronize()
    expected = (a @ a + 1).clone()
    check("replay before pause", torch.allclose(out, expected))

    # 1. graph alive: pause must keep the stack.
    out.zero_()
    freed, st = pause_checked("graph alive")
    limit = stack_limit(rt)
    check("stack kept while a graph lives", limit >= RAISED, f"{limit} B/thread")
    g.replay()
    torch.cuda.synchronize()  # a lowered limit fails here with 719, for good
    check("replay while nccl paused", torch.allclose(out, expected))
    show("graph alive", st, freed)
    check("stats: stack kept, with a reason",
          st.get("stack_kept_bytes", 0) > 0 and bool(st.get("stack_kept_reason")),
          str(st.get("stack_kept_reason")))
    check("stats: nothing lowered", st.get("stack_lowered_bytes", -1) == 0)
    memsaver.resume("nccl")
    check("limit after resume", stack_limit(rt) >= RAISED, f"{stack_limit(rt)}")
    check("all_reduce after resume", all_reduce_ok(2))
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    check("replay after resume", torch.allclose(out, expected))

    # 2. graph destroyed: the application's own cudaDeviceSetLimit(1744) still holds the
    # stack (memsaver never lowers a limit the application set).
    del g
    gc.collect()
    freed, st = pause_checked("graph destroyed")
    show("graph destroyed", st, freed)
    limit = stack_limit(rt)
    check("stack kept for the application's limit", limit >= RAISED, f"{limit} B/thread")
    check("reason: the application's limit",
          "application set the limit" in str(st.get("stack_kept_reason")),
          str(st.get("stack_kept_reason")))
    memsaver.resume("nccl")
    check("all_reduce after second resume", all_reduce_ok(3))
    dist.destroy_process_group()


KERNEL = r"""
#include <cuda_runtime.h>
#define INTS 448  /* 1792 bytes of stack frame per thread: more than CUDA's default 1024 */
__global__ void deep(int* out, int n) {
    volatile int buf[INTS];
    for (int i = 0; i < INTS; ++i) buf[i] = i * n;
    out[threadIdx.x] = buf[(n * 7 + threadIdx.x) % INTS];
}
extern "C" int launch_deep(int* out, int n) {
    deep<<<1, 32>>>(out, n);
    return (int)cudaDeviceSynchronize();
}
"""


def freed_case():
    """Child process: a stack-hungry kernel grows the limit; no graph, no explicit limit."""
    lib = sys.argv[2]
    init_nccl()
    rt = cudart()
    check("all_reduce before", all_reduce_ok(1))
    before = stack_limit(rt)
    k = ctypes.CDLL(lib)
    out = torch.zeros(32, dtype=torch.int32, device="cuda")
    rc = k.launch_deep(ctypes.c_void_p(out.data_ptr()), 3)
    grown = stack_limit(rt)
    check("kernel grew the limit", rc == 0 and grown > before, f"{before} -> {grown} B/thread")
    freed, st = pause_checked("stack lowered")
    show("no graph, no explicit limit", st, freed)
    check("stack lowered to 1024", stack_limit(rt) == 1024, f"{stack_limit(rt)}")
    check("stats: lowered bytes reported", st.get("stack_lowered_bytes", 0) > 0)
    check("stats: nothing kept", st.get("stack_kept_bytes", -1) == 0
          and st.get("stack_kept_reason") is None)
    memsaver.resume("nccl")
    check("limit restored by resume", stack_limit(rt) == grown, f"{stack_limit(rt)}")
    check("all_reduce after resume", all_reduce_ok(2))
    rc = k.launch_deep(ctypes.c_void_p(out.data_ptr()), 5)
    expect = torch.tensor([((5 * 7 + t) % 448) * 5 for t in range(32)], dtype=torch.int32,
                          device="cuda")
    check("kernel after resume", rc == 0 and bool(torch.equal(out, expect)))
    dist.destroy_process_group()


def main():
    if os.environ.get("LD_PRELOAD", "").find("libmemsaver") < 0:
        print("FAIL run under LD_PRELOAD=$(python3 -m memsaver preload-path)")
        return 1
    if len(sys.argv) > 2 and sys.argv[1] == "--freed":
        freed_case()
        return 1 if FAILED else 0
    skip_freed = "--skip-freed-case" in sys.argv[1:]
    graph_cases()
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                    if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if skip_freed:
        print("SKIP freed case (asked: --skip-freed-case)")
    elif nvcc is None:
        check("nvcc found for the freed case", False,
              "install the CUDA toolkit, or pass --skip-freed-case to leave the case out")
    else:
        with tempfile.TemporaryDirectory() as d:
            src, lib = os.path.join(d, "deep.cu"), os.path.join(d, "libdeep.so")
            with open(src, "w") as f:
                f.write(KERNEL)
            build = subprocess.run([nvcc, "-O2", "-shared", "-Xcompiler", "-fPIC",
                                    "-arch=native", "-o", lib, src],
                                   capture_output=True, text=True)
            if check("nvcc builds the stack-hungry kernel", build.returncode == 0,
                     build.stderr.strip()[-500:]):
                env = dict(os.environ, MASTER_PORT="29532")
                child = subprocess.run([sys.executable, __file__, "--freed", lib], env=env,
                                       timeout=300)
                check("freed case (child process)", child.returncode == 0)
    print("FAIL" if FAILED else "PASS", "graph_stack", ", ".join(FAILED), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
