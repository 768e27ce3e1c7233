#!/usr/bin/env python3
"""pynccl-style NCCL under memsaver (issue 4): the pattern of vLLM's and SGLang's pynccl.

The communicator is created and driven through ctypes, with the functions looked up in
libnccl's own handle (`ctypes.CDLL(path).ncclAllReduce`), not through torch. Checks, on every
rank, for CYCLES cycles: an all-reduce is correct; `memsaver.pause("nccl")` frees the
communicator's device memory; an all-reduce issued while paused is refused with
ncclInvalidUsage (5) and leaves its buffer untouched; after `memsaver.resume("nccl")` the same
communicator all-reduces correctly again.

Run under the preload, one process per GPU:

    LD_PRELOAD=$(python3 -m memsaver preload-path) torchrun --nproc-per-node 2 \\
        tests/gpu/nccl_pynccl.py [CYCLES]

Exits non-zero on a wrong result, an unexpected NCCL status, or a pause that frees less than
90% of the device memory the hook says NCCL owns less what it keeps resident (nccl_floor.py).
"""
import ctypes
import json
import os
import sys

import memsaver
import torch
import torch.distributed as dist
from nccl_floor import PauseCheck

NCCL_FLOAT32, NCCL_SUM, NCCL_INVALID_USAGE = 7, 0, 5


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def nccl_library():
    """The libnccl torch loaded: pynccl finds the same file (vLLM: find_nccl_library)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libnccl.so" in line:
                return line.split()[-1]
    return "libnccl.so.2"


class PyNccl:
    def __init__(self, rank, world):
        self.lib = ctypes.CDLL(nccl_library())
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        uid = UniqueId()
        if rank == 0:
            self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        box = [bytes(uid.internal)]
        dist.broadcast_object_list(box, src=0)
        ctypes.memmove(uid.internal, box[0], 128)
        self.comm = ctypes.c_void_p()
        self.lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                              UniqueId, ctypes.c_int]
        self.check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), world, uid, rank),
                   "ncclCommInitRank")

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.ncclGetErrorString(rc).decode()} ({rc})")

    def all_reduce(self, x):
        """In-place sum; returns NCCL's status."""
        stream = torch.cuda.current_stream().cuda_stream
        return self.lib.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()),
                                      ctypes.c_size_t(x.numel()), NCCL_FLOAT32, NCCL_SUM,
                                      self.comm, ctypes.c_void_p(stream))

    def destroy(self):
        self.check(self.lib.ncclCommDestroy(self.comm), "ncclCommDestroy")


def main():
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")  # only to hand the unique id around
    nccl = PyNccl(rank, world)
    ok, refused = True, []
    check = PauseCheck()
    for step in range(cycles + 1):
        x = torch.full((1 << 20,), float(rank + step), device="cuda")
        nccl.check(nccl.all_reduce(x), "ncclAllReduce")
        torch.cuda.synchronize()
        ok &= bool(torch.all(x == sum(r + step for r in range(world))).item())
        if step == cycles:
            break
        dist.barrier()
        f0 = torch.cuda.mem_get_info()[0]
        check.before(memsaver.nccl_stats())
        memsaver.pause("nccl")
        check.paused(torch.cuda.mem_get_info()[0] - f0, memsaver.nccl_stats())
        y = torch.full((1024,), 1.0, device="cuda")
        refused.append(nccl.all_reduce(y))
        torch.cuda.synchronize()
        ok &= bool(torch.all(y == 1.0).item())
        memsaver.resume("nccl")
    s = memsaver.nccl_stats()
    report = {
        "rank": rank, "cycles": cycles, "correct": ok,
        **check.report(),
        "status_while_paused": sorted(set(refused)),
        "nccl_owned_mib": round(s["owned_bytes"] / (1 << 20), 1),
        "library": nccl_library(),
    }
    print("PYNCCL " + json.dumps(report), flush=True)
    nccl.destroy()
    dist.destroy_process_group()
    short = check.failures()
    if not ok or short or set(refused) != {NCCL_INVALID_USAGE}:
        print(f"rank {rank}: FAIL (correct={ok}, statuses while paused={sorted(set(refused))}) "
              + "; ".join(short))
        sys.exit(1)
    print(f"rank {rank}: PASS")


if __name__ == "__main__":
    main()
