#!/usr/bin/env python3
"""GPU check of the NCCL hook's first stage (issue 4): with libmemsaver.so preloaded, NCCL
(stock, from torch's wheel) resolves its driver calls through memsaver, and the hook sees
the device memory NCCL allocates. Observation only: nothing is paused yet.

Run with torchrun, one process per GPU, under the preload:

    LD_PRELOAD=$(python3 -m memsaver preload-path) NCCL_NVLS_ENABLE=0 \\
        torchrun --nproc-per-node 2 tests/gpu/nccl_observe.py

Each rank prints NCCL's footprint (cudaMemGetInfo before init_process_group and after the
world group's all_reduce and all_to_all plus a subgroup's all_reduce) beside what the hook
recorded. Exits non-zero if the hook was not installed or saw no NCCL memory.
"""
import json
import os
import sys

import memsaver
import torch
import torch.distributed as dist

MIB = 1 << 20


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]

    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(x)
    out = torch.empty(world * 1024, device="cuda")
    dist.all_to_all_single(out, torch.ones(world * 1024, device="cuda"))
    sub = dist.new_group(list(range(world)))
    dist.all_reduce(x, group=sub)
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    ok_result = bool(torch.all(x == world * world).item())

    s = memsaver.nccl_stats()
    footprint = free0 - free1
    seen = s["owned_bytes"]
    report = {
        "rank": rank,
        "footprint_mib": round(footprint / MIB, 1),
        "owned_mib": round(seen / MIB, 1),
        "owned_pct_of_footprint": round(100.0 * seen / footprint, 1) if footprint else None,
        "imported_mib": round(s["imported_bytes"] / MIB, 1),
        "owned_handles": s["owned_handles"],
        "exported_handles": s["exported_handles"],
        "imported_handles": s["imported_handles"],
        "resident_host_mib": round(s["resident_host_bytes"] / MIB, 1),
        "resident_nic_mib": round(s["resident_nic_bytes"] / MIB, 1),
        "multicast_objects": s["multicast_objects"],
        "hooked": s["hooked"],
        "collectives_correct": ok_result,
    }
    print("NCCL_OBSERVE " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if not (s["hooked"] and seen > 0 and ok_result):
        print(f"rank {rank}: FAIL (hook not installed, no NCCL memory seen, or wrong result)")
        sys.exit(1)


if __name__ == "__main__":
    main()
