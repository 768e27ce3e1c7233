#!/usr/bin/env python3
"""GPU check of the verl-style profile (issue 5) with tensors and NCCL, one process per GPU:

    LD_PRELOAD=$(python3 -m memsaver preload-path) NCCL_NVLS_ENABLE=0 \\
        torchrun --nproc-per-node 2 tests/gpu/profile_verl.py [CYCLES]

Each rank allocates rollout weights (cpu backup), a KV cache and a CUDA graph's memory in the
profile's regions, sets up NCCL (world group, all_reduce and all_to_all), then runs
docs/examples/verl_grpo.yaml: `sleep`, then `wake` whose `sync_weights` callback all-reduces the
weights over NCCL while the KV cache is still paused. Checks: memory freed by sleep, weights
intact and synced, the graph replays, collectives correct; prints each stage's report.
Exits non-zero on any failure.
"""
import os
import pathlib
import sys

import memsaver
import torch
import torch.distributed as dist

GIB = 1 << 30
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples" / "verl_grpo.yaml"


def main():
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    profile = memsaver.load_profile(str(EXAMPLE))
    with profile.region("weights"):
        weights = torch.full((GIB // 4,), float(rank + 1), device="cuda")  # 1 GiB
    with profile.region("kv_cache"):
        kv = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
    static_in = torch.randn(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _ = static_in * 2
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with memsaver.cuda_graph(graph, tag="cuda_graph", backup=profile.tags["cuda_graph"]):
        static_out = static_in * 2
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    out = torch.empty(world * 1024, device="cuda")
    dist.all_to_all_single(out, torch.ones(world * 1024, device="cuda"))
    torch.cuda.synchronize()
    ok = True
    for cycle in range(cycles):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        sleep = profile.run("sleep")
        freed = torch.cuda.mem_get_info()[0] - free0

        def sync_weights():
            # Runs with NCCL and the weights resident, the KV cache still paused: every rank
            # ends with the same weights (the mean of all ranks').
            if not memsaver.stats().tags["kv_cache"].paused:
                raise RuntimeError("sync_weights ran with the KV cache resident")
            dist.all_reduce(weights)
            weights.div_(world)
            torch.cuda.synchronize()

        wake = profile.run("wake", callbacks={"sync_weights": sync_weights})
        # The mean of all ranks' initial weights, kept across every sleep by the cpu backup.
        w_ok = bool(torch.all(weights == (world + 1) / 2).item())
        kv.fill_(cycle)
        graph.replay()
        torch.cuda.synchronize()
        g_ok = bool(torch.allclose(static_out, static_in * 2))
        y = torch.full((1 << 20,), float(rank), device="cuda")
        dist.all_reduce(y)
        c_ok = bool(torch.all(y == sum(range(world))).item())
        ok &= w_ok and g_ok and c_ok and freed >= 5 * GIB
        if rank == 0:
            print(f"cycle {cycle}: sleep freed {freed / GIB:.2f} GiB; weights ok {w_ok}, "
                  f"graph ok {g_ok}, collectives ok {c_ok}")
            print(sleep)
            print(wake)
    dist.destroy_process_group()
    print(f"rank {rank}: {'PASS' if ok else 'FAIL'}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
