#!/usr/bin/env python3
"""GPU check: a rank stopped across its peer's pauses and resumes catches up before NCCL runs.

Run with torchrun, one process per GPU (2 GPUs), under the preload:

    LD_PRELOAD=$(python3 -m memsaver preload-path) NCCL_NVLS_ENABLE=0 \\
        MEMSAVER_NCCL_TIMEOUT_MS=3000 torchrun --nproc-per-node 2 tests/gpu/nccl_stopped_rank.py

Both ranks all-reduce on torch's NCCL communicator. Rank 0 then stops rank 1 (SIGSTOP) and
pauses and resumes ``nccl`` twice on its own:

* each pause must return a ``PeerError`` naming rank 1 as stopped, with what it still maps
  (before, the second pause returned without error while rank 1 still mapped the first
  generation), and ``stats()`` must count those bytes as held while paused;
* each resume brings rank 0's own memory back and fails naming rank 1, whose buffers it
  cannot fetch while rank 1 is stopped.

Rank 0 continues rank 1. Rank 0's imports of rank 1's buffers are paused (rank 1 never
paused them, and each process follows its peers' pauses and resumes in its own), so, as the
errors say, the group pauses and resumes ``nccl`` together: rank 1 releases the first
generation it still mapped, and the all-reduces after it must be exact on both ranks, and
after one more joint cycle too. (An importer woken while its owner stays resident catches up at
its next NCCL call instead: checked on the fake driver, where an owner may hold nothing of its
importer's; with NCCL's symmetric P2P both ranks import each other's buffers.) Exit status
non-zero on any failure; one ``NCCL_STOPPED {json}`` line per rank.
"""
import faulthandler
import json
import os
import signal
import sys
import time

import memsaver
import torch
import torch.distributed as dist


def allreduce_exact(rank, world, rounds=3):
    for i in range(rounds):
        x = torch.full((1 << 20,), float(rank + 1 + i), device="cuda")
        dist.all_reduce(x)
        want = sum(r + 1 + i for r in range(world))
        if not torch.all(x == want):
            raise AssertionError(f"all_reduce {i}: {x[:4].tolist()} != {want}")
    torch.cuda.synchronize()


def held_while_paused():
    export = memsaver.stats().shared_exports.get("nccl")
    return export.held_while_paused if export else 0


def say(rank, what):
    print(f"rank {rank}: {what}", flush=True)


def main():
    # A hang is a failure: the stacks, then exit.
    faulthandler.dump_traceback_later(float(os.environ.get("HANG_S", "90")), exit=True)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    gloo = dist.new_group(backend="gloo")
    out = {"rank": rank, "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    failures = []
    allreduce_exact(rank, world)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=gloo)
    if rank == 0:
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(0.5)
        for cycle in range(2):
            try:
                memsaver.pause("nccl")
                failures.append(f"pause {cycle}: no error though rank 1 still maps the memory")
            except memsaver.PeerError as e:
                text = str(e)
                if f"process {pids[1]}" not in text or "stopped" not in text:
                    failures.append(f"pause {cycle} does not name the stopped rank: {text}")
            held = held_while_paused()
            out[f"held_while_paused_{cycle}"] = held
            if held <= 0:
                failures.append(f"pause {cycle}: stats count nothing held while paused")
            try:
                memsaver.resume("nccl")
                failures.append(f"resume {cycle}: no error though rank 1 is stopped")
            except memsaver.PeerError as e:
                if f"process {pids[1]}" not in str(e):
                    failures.append(f"resume {cycle} does not name the stopped rank: {e}")
        say(rank, f"two cycles done: {failures}")
        os.kill(pids[1], signal.SIGCONT)
    dist.barrier(group=gloo)
    say(rank, "after the wake barrier")
    # Rank 0 could not map rank 1's buffers (rank 1 never paused them): the group pauses and
    # resumes together, as the errors said, and every rank maps every peer's current memory.
    try:
        t = time.perf_counter()
        memsaver.pause("nccl")
        memsaver.resume("nccl")
        out["joint_cycle_s"] = round(time.perf_counter() - t, 3)
        allreduce_exact(rank, world, rounds=5)
        say(rank, "all-reduces after the joint cycle exact")
        memsaver.pause("nccl")
        memsaver.resume("nccl")
        allreduce_exact(rank, world, rounds=5)
        out["allreduce_after_wake"] = "exact"
    except Exception as e:  # noqa: BLE001 - reported and counted as a failure
        failures.append(f"after the wake: {type(e).__name__}: {e}")
    out["failures"] = failures
    print("NCCL_STOPPED " + json.dumps(out), flush=True)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
