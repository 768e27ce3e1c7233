#!/usr/bin/env python3
"""GPU check: an NCCL collective issued while the `nccl` tag is paused is refused with an
NCCL error (ncclInvalidUsage) instead of touching released memory, and the communicator works
again after resume. Run like nccl_pause.py:

    LD_PRELOAD=$(python3 -m memsaver preload-path) NCCL_NVLS_ENABLE=0 \\
        torchrun --nproc-per-node 2 tests/gpu/nccl_guard.py
"""
import json
import os
import sys

import memsaver
import torch
import torch.distributed as dist


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    memsaver.pause("nccl")
    refused, message = False, ""
    try:
        dist.all_reduce(torch.ones(16, device="cuda"))
        torch.cuda.synchronize()
    except Exception as e:  # torch raises DistBackendError (a RuntimeError)
        message = str(e).splitlines()[0][:200]
        # Refused by the guard (ncclInvalidUsage), not failing for some other reason.
        refused = "invalid usage" in message
    memsaver.resume("nccl")
    y = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(y)
    torch.cuda.synchronize()
    ok_after = bool(torch.all(y == sum(range(1, world + 1))).item())
    result = {"rank": rank, "refused_while_paused": refused, "error": message,
              "correct_after_resume": ok_after}
    print("NCCL_GUARD " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    if not (refused and ok_after):
        sys.exit(1)


if __name__ == "__main__":
    main()
