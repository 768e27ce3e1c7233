#!/usr/bin/env python3
"""GPU check of pausing NCCL's own memory across processes (issue 4), stock NCCL.

Run with torchrun, one process per GPU, under the preload:

    LD_PRELOAD=$(python3 -m memsaver preload-path) NCCL_NVLS_ENABLE=0 \\
        torchrun --nproc-per-node 2 tests/gpu/nccl_pause.py [CYCLES]

World group plus two subgroups; all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
and send/recv checked before and after each pause/resume cycle of the `nccl` tag (with a
tensor tag paused alongside), and a CUDA graph of two all_reduces (captured once, with NCCL's
kernels in it) replayed and checked after each resume. Reports per rank the memory freed by pause (cudaMemGetInfo)
against NCCL's footprint and the hook's own figures, pause/resume times, and the change in
free device memory and open fds between the end of the first cycle and the end of the last.
Every rank must run under the preload (exports are exchanged as memsaver tokens).
MEMSAVER_NCCL_BACKUP=headers is reported in the output when set.
Exits non-zero on a wrong result, a failed call, a pause that frees less than 90% of the
device memory the hook says NCCL owns less what it keeps resident (nccl_floor.py), or growth in
device memory (more than one 2 MiB granule) or open fds across cycles.
"""
import gc
import json
import os
import statistics
import sys
import threading
import time

import memsaver
import torch
import torch.distributed as dist
from nccl_floor import PauseCheck

MIB = 1 << 20


def collectives(groups, rank, world, step):
    ok = True
    for g in groups:
        x = torch.full((1 << 20,), float(rank + step), device="cuda")
        dist.all_reduce(x, group=g)
        ok &= bool(torch.all(x == sum(r + step for r in range(world))).item())
        parts = [torch.empty(1024, device="cuda") for _ in range(world)]
        dist.all_gather(parts, torch.full((1024,), float(rank), device="cuda"), group=g)
        ok &= all(bool(torch.all(p == r).item()) for r, p in enumerate(parts))
        out = torch.empty(1024, device="cuda")
        dist.reduce_scatter_tensor(out, torch.ones(world * 1024, device="cuda"), group=g)
        ok &= bool(torch.all(out == world).item())
        a2a = torch.empty(world * 256, device="cuda")
        dist.all_to_all_single(a2a, torch.full((world * 256,), float(rank), device="cuda"), group=g)
        ok &= all(bool(torch.all(a2a[r * 256:(r + 1) * 256] == r).item()) for r in range(world))
        b = torch.full((1024,), float(rank), device="cuda")
        dist.broadcast(b, src=0, group=g)
        ok &= bool(torch.all(b == 0).item())
    peer = (rank + 1) % world
    send = torch.full((4096,), float(rank), device="cuda")
    recv = torch.empty(4096, device="cuda")
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer),
                                   dist.P2POp(dist.irecv, recv, (rank - 1) % world)])
    for r in reqs:
        r.wait()
    ok &= bool(torch.all(recv == (rank - 1) % world).item())
    torch.cuda.synchronize()
    return ok


class GraphedAllReduce:
    """A CUDA graph of two all_reduces on one group (4 KiB and 16 MiB, so that NCCL picks
    different protocols), captured once with NCCL's kernels inside it and replayed after every
    resume: the graph keeps NCCL's device addresses, which must hold NCCL's state again."""

    SIZES = (1 << 10, 4 << 20)  # float32 elements

    def __init__(self, group, rank, world):
        self.rank, self.world = rank, world
        self.bufs = [torch.zeros(n, device="cuda") for n in self.SIZES]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm on the capture's stream, as torch asks
            for b in self.bufs:
                dist.all_reduce(b, group=group)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for b in self.bufs:
                dist.all_reduce(b, group=group)
        torch.cuda.synchronize()

    def replay(self, step):
        """Replays once with fresh inputs; True when every rank's sums are right."""
        for b in self.bufs:
            b.fill_(float(self.rank + step))
        self.graph.replay()
        torch.cuda.synchronize()
        want = sum(r + step for r in range(self.world))
        return all(bool(torch.all(b == want).item()) for b in self.bufs)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def main():
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    free_start = torch.cuda.mem_get_info()[0]
    reserved_start = torch.cuda.memory_reserved()
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    ranks = list(range(world))
    groups = [dist.group.WORLD, dist.new_group(ranks), dist.new_group(ranks)]
    ok = collectives(groups, rank, world, 0)
    graph = GraphedAllReduce(groups[1], rank, world)
    graph_ok = graph.replay(0)
    with memsaver.region("kv_cache"):
        kv = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    # What NCCL added: the drop in free memory, less what torch's caching allocator holds
    # (the collectives' tensors and the 1 GiB kv_cache tensor).
    torch_growth = torch.cuda.memory_reserved() - reserved_start
    footprint = free_start - free_before - torch_growth
    pause_ms, resume_ms, freed, free_after, fds_after = [], [], [], [], []
    check = PauseCheck()
    for step in range(1, cycles + 1):
        dist.barrier()
        torch.cuda.synchronize()
        f0 = torch.cuda.mem_get_info()[0]
        check.before(memsaver.nccl_stats())
        c0 = memsaver.stats().driver_calls
        t0 = time.perf_counter()
        memsaver.pause("nccl")
        pause_ms.append((time.perf_counter() - t0) * 1e3)
        c1 = memsaver.stats().driver_calls
        freed.append(torch.cuda.mem_get_info()[0] - f0)
        check.paused(freed[-1], memsaver.nccl_stats())
        memsaver.pause("kv_cache")
        memsaver.resume("kv_cache")
        c2 = memsaver.stats().driver_calls
        t0 = time.perf_counter()
        memsaver.resume("nccl")
        resume_ms.append((time.perf_counter() - t0) * 1e3)
        c3 = memsaver.stats().driver_calls
        # The driver calls of this cycle's pause and resume of nccl, by kind.
        calls = [{k: v - a.get(k, 0) for k, v in b.items() if v - a.get(k, 0)}
                 for a, b in ((c0, c1), (c2, c3))]
        ok &= collectives(groups, rank, world, step)
        graph_ok &= graph.replay(step)
        kv.fill_(step)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_after.append(torch.cuda.mem_get_info()[0])
        fds_after.append(open_fds())
    s = memsaver.nccl_stats()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_end = torch.cuda.mem_get_info()[0]
    report = {
        "rank": rank, "cycles": cycles, "collectives_correct": ok,
        "graph_replays_correct": graph_ok,
        "nccl_footprint_mib": round(footprint / MIB, 1),
        "torch_reserved_growth_mib": round(torch_growth / MIB, 1),
        "nccl_owned_mib": round(s["owned_bytes"] / MIB, 1),
        "exported_mib": round(s["exported_bytes"] / MIB, 1),
        "imported_mib": round(s["imported_bytes"] / MIB, 1),
        "freed_by_pause_mib_median": round(statistics.median(freed) / MIB, 1),
        "freed_pct_of_footprint": round(100.0 * statistics.median(freed) / footprint, 1),
        "pause_ms_median": round(statistics.median(pause_ms), 2),
        "resume_ms_median": round(statistics.median(resume_ms), 2),
        "pause_ms_max": round(max(pause_ms), 2), "resume_ms_max": round(max(resume_ms), 2),
        "pause_ms_first": round(pause_ms[0], 2), "resume_ms_first": round(resume_ms[0], 2),
        "calls_pause_last": calls[0], "calls_resume_last": calls[1],
        "device_free_drift_mib": round((free_before - free_end) / MIB, 1),
        "device_growth_after_first_cycle_mib": round((free_after[0] - free_after[-1]) / MIB, 1),
        "open_fds_growth_after_first_cycle": fds_after[-1] - fds_after[0],
        "owned_handles": s["owned_handles"], "exported_handles": s["exported_handles"],
        "imported_handles": s["imported_handles"], "runs": s.get("runs"),
        "freed_held_mib": round(s.get("freed_held_bytes", 0) / MIB, 1),
        "backup": os.environ.get("MEMSAVER_NCCL_BACKUP", "headers (default)"),
        "nccl_proto": os.environ.get("NCCL_PROTO", "default"),
        **check.report(),
    }
    print("NCCL_PAUSE " + json.dumps(report), flush=True)
    grew = free_after[0] - free_after[-1] > 2 * MIB or fds_after[-1] > fds_after[0]
    short = check.failures()
    failed = not ok or not graph_ok or short or grew
    if failed:
        print(f"rank {rank}: FAIL (correct={ok}, graph={graph_ok}, grew={grew}) "
              + "; ".join(short), flush=True)
    # A graph with NCCL kernels in it keeps its communicator from being destroyed (torch
    # #115388): the graph goes first. Teardown is torch's and NCCL's, not what is checked, so a
    # hang there is reported and cut short.
    graph.graph.reset()
    del graph
    gc.collect()
    torch.cuda.synchronize()
    done = threading.Event()

    def cut_short():
        if not done.wait(60):
            print(f"rank {rank}: teardown (barrier, destroy_process_group) hung for 60 s; "
                  "exiting", flush=True)
            os._exit(1 if failed else 3)

    threading.Thread(target=cut_short, daemon=True).start()
    dist.barrier()
    dist.destroy_process_group()
    done.set()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
