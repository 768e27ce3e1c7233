#!/usr/bin/env python3
"""Pause/resume of `nccl` on a custom-built NCCL (all_reduce and send/recv only): run by
tests/gpu/nccl_230.sh. Checks the results after each cycle, reports NCCL's version, the memory
freed and the times; exits non-zero on a wrong result, an NCCL that is not hooked, or a pause
that frees less than 90% of the device memory the hook says NCCL owns less what it keeps
resident (nccl_floor.py)."""
import json
import os
import statistics
import sys
import time

import memsaver
import torch
import torch.distributed as dist
from nccl_floor import PauseCheck

MIB = 1 << 20


def step(rank, world, k):
    x = torch.full((1 << 20,), float(rank + k), device="cuda")
    dist.all_reduce(x)
    peer = (rank + 1) % world
    send, recv = torch.full((4096,), float(rank), device="cuda"), torch.empty(4096, device="cuda")
    for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer),
                                     dist.P2POp(dist.irecv, recv, (rank - 1) % world)]):
        r.wait()
    torch.cuda.synchronize()
    return bool(torch.all(x == sum(r + k for r in range(world))).item()) and \
        bool(torch.all(recv == (rank - 1) % world).item())


def nccl_runtime_version():
    """The version of the libnccl actually in use (torch reports the one it was built with)."""
    import ctypes

    v = ctypes.c_int()
    ctypes.CDLL(None).ncclGetVersion(ctypes.byref(v))
    return f"{v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}"


def main():
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.ones(1, device="cuda")
    free0 = torch.cuda.mem_get_info()[0]
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    ok = step(rank, world, 0)
    torch.cuda.empty_cache()
    footprint = free0 - torch.cuda.mem_get_info()[0] - torch.cuda.memory_reserved()
    freed, tp, tr = [], [], []
    check = PauseCheck()
    for k in range(1, cycles + 1):
        dist.barrier()
        torch.cuda.synchronize()
        f = torch.cuda.mem_get_info()[0]
        check.before(memsaver.nccl_stats())
        t0 = time.perf_counter()
        memsaver.pause("nccl")
        tp.append((time.perf_counter() - t0) * 1e3)
        freed.append(torch.cuda.mem_get_info()[0] - f)
        check.paused(freed[-1], memsaver.nccl_stats())
        t0 = time.perf_counter()
        memsaver.resume("nccl")
        tr.append((time.perf_counter() - t0) * 1e3)
        ok &= step(rank, world, k)
    s = memsaver.nccl_stats()
    print("NCCL_230 " + json.dumps({
        "rank": rank, "nccl_version": nccl_runtime_version(),
        "hooked": s["hooked"], "correct": ok, "footprint_mib": round(footprint / MIB, 1),
        "owned_mib": round(s["owned_bytes"] / MIB, 1),
        "freed_mib_median": round(statistics.median(freed) / MIB, 1),
        "pause_ms_median": round(statistics.median(tp), 1),
        "resume_ms_median": round(statistics.median(tr), 1),
        **check.report(),
    }), flush=True)
    dist.destroy_process_group()
    short = check.failures()
    if not ok or not s["hooked"] or short:
        print(f"rank {rank}: FAIL (correct={ok}, hooked={s['hooked']}) " + "; ".join(short), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
