#!/usr/bin/env python3
"""GPU check: one rank out of device memory at ``resume("nccl")``; its peer is told at once.

Run with torchrun, one process per GPU (2 GPUs), under the preload:

    LD_PRELOAD=$(python3 -m memsaver preload-path) NCCL_NVLS_ENABLE=0 \\
        MEMSAVER_NCCL_TIMEOUT_MS=60000 torchrun --nproc-per-node 2 tests/gpu/nccl_resume_oom.py

Both ranks all-reduce on torch's NCCL communicator, then pause ``nccl``. While they are paused,
a helper process without memsaver (as a rollout engine would be) takes all but 16 MiB of GPU
0's free memory. Both ranks resume together:

* rank 0 must fail with ``ResumeOutOfMemoryError`` naming what is still paused;
* rank 1 must fail with a ``PeerError`` that names rank 0's out-of-memory and says to call
  resume again, well within the 60 s timeout (it is told, it does not wait for the deadline).

The helper frees its memory; both resume again, which must succeed, and the all-reduces after
it must be exact. Exit status non-zero on any failure; one ``NCCL_RESUME_OOM {json}`` line per
rank.
"""
import json
import os
import subprocess
import sys
import time

import memsaver
import torch
import torch.distributed as dist

MIB = 1 << 20
# What the helper leaves free on GPU 0: far less than NCCL's memory there.
LEFT = 16 * MIB
HOG = f"""
import sys, torch
torch.cuda.set_device(0)
torch.empty(1, device="cuda")
free, _ = torch.cuda.mem_get_info()
x = torch.empty(free - {LEFT}, dtype=torch.uint8, device="cuda")
print("took", x.numel(), flush=True)
sys.stdin.readline()
"""


def allreduce_exact(rank, world, rounds=3):
    for i in range(rounds):
        x = torch.full((1 << 20,), float(rank + 1 + i), device="cuda")
        dist.all_reduce(x)
        want = sum(r + 1 + i for r in range(world))
        if not torch.all(x == want):
            raise AssertionError(f"all_reduce {i}: {x[:4].tolist()} != {want}")
    torch.cuda.synchronize()


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    gloo = dist.new_group(backend="gloo")
    out = {"rank": rank, "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    failures = []
    allreduce_exact(rank, world)
    memsaver.pause("nccl")
    hog = None
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        hog = subprocess.Popen([sys.executable, "-c", HOG], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        out["hog"] = hog.stdout.readline().strip()
    dist.barrier(group=gloo)
    t = time.perf_counter()
    try:
        memsaver.resume("nccl")
        err = None
    except memsaver.MemsaverError as e:
        err = e
    out["failed_resume_s"] = round(time.perf_counter() - t, 3)
    out["failed_resume_error"] = f"{type(err).__name__}: {err}"
    if rank == 0:
        if not isinstance(err, memsaver.ResumeOutOfMemoryError):
            failures.append(f"rank 0 expected ResumeOutOfMemoryError, got {out['failed_resume_error']}")
    else:
        text = str(err)
        if not (isinstance(err, memsaver.PeerError) and "its own resume of 'nccl' failed" in text
                and "out of device memory" in text and "call resume('nccl') again" in text):
            failures.append(f"rank 1 expected a PeerError naming rank 0's out-of-memory, got "
                            f"{out['failed_resume_error']}")
        if out["failed_resume_s"] > 5:
            failures.append(f"rank 1 waited {out['failed_resume_s']} s: it was not told at once")
    dist.barrier(group=gloo)
    if hog is not None:
        hog.stdin.write("\n")
        hog.stdin.flush()
        hog.wait(timeout=60)
    dist.barrier(group=gloo)
    t = time.perf_counter()
    try:
        memsaver.resume("nccl")
    except memsaver.MemsaverError as e:
        failures.append(f"the retry failed: {type(e).__name__}: {e}")
    out["retry_s"] = round(time.perf_counter() - t, 3)
    if not failures:
        try:
            allreduce_exact(rank, world, rounds=5)
            out["allreduce_after_retry"] = "exact"
        except Exception as e:  # noqa: BLE001 - reported and counted as a failure
            failures.append(f"after the retry: {e}")
    out["failures"] = failures
    print("NCCL_RESUME_OOM " + json.dumps(out), flush=True)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
