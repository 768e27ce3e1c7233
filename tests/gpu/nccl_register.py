#!/usr/bin/env python3
"""GPU check of NCCL's user-buffer registration of memsaver memory (2 GPUs, stock NCCL).

Run with torchrun, one process per GPU, under the preload:

    LD_PRELOAD=$(python3 -m memsaver preload-path) NCCL_NVLS_ENABLE=0 \\
        torchrun --nproc-per-node 2 tests/gpu/nccl_register.py [CYCLES]

The buffers are registered with ``ncclCommRegister`` on torch's communicator (its
``_comm_ptr()``, through libnccl's handle); with ``--torch-hook`` instead by torch itself
(``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1`` must then be set: torch registers every
caching-allocator segment). ``--resume-first`` pauses and resumes the buffers before they are
registered, so that NCCL registers them inside one physical allocation of both and the peers
map each later generation at the buffer's place in it.

Each rank allocates a ``--mib`` (default 256) send and receive buffer in
``memsaver.region("weights", backup="cpu")`` and exchanges them with send/recv, which NCCL runs
zero-copy through the peer's registered buffer (``ipcRegisterBuffer``: the owner exports the
buffer's handle, the peer's proxy imports and maps it). Then, per cycle:

1. the exchange is correct, and memsaver's stats show the registration went through it: the
   tag ``weights`` has exports with an importer, and this rank maps a peer's buffer
   (``shared_imports`` with ``via == "nccl"``);
2. both ranks pause ``weights``: ``torch.cuda.mem_get_info()`` shows at least 90% of the two
   buffers back (the peer's mapping was released too, else the memory would stay held), and
   the import shows ``paused``; an all_reduce of a paused buffer is refused by both ranks
   (``ncclInvalidUsage``, no hang);
3. both ranks resume, write new values and exchange again: correct, through the same
   registration (the peer's mapping was rebuilt at the same address).

At the end (explicit registration only) the buffers are deregistered: the peers drop their
imports and tell the owners, and a pause then frees the buffers without them.

Exit status non-zero on any failure; one ``NCCL_REGISTER {json}`` line per rank.
"""
import argparse
import ctypes
import json
import os
import sys
import time

import memsaver
import torch
import torch.distributed as dist

MIB = 1 << 20
TAG = "weights"


def exchange(send, recv, rank, world):
    """send to the next rank, receive from the previous one (one batched step)."""
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    torch.cuda.synchronize()


def libnccl():
    """The libnccl this process loaded (torch's)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libnccl.so" in line}
    if not paths:
        raise RuntimeError("no libnccl.so loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


def nccl_register(tensors):
    """ncclCommRegister of each tensor on the default group's communicator."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
    comm = ctypes.c_void_p(backend._comm_ptr())
    lib = libnccl()
    lib.ncclCommRegister.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.POINTER(ctypes.c_void_p)]
    handles = []
    for t in tensors:
        h = ctypes.c_void_p()
        rc = lib.ncclCommRegister(comm, ctypes.c_void_p(t.data_ptr()),
                                  t.numel() * t.element_size(), ctypes.byref(h))
        if rc != 0:
            raise RuntimeError(f"ncclCommRegister returned {rc}")
        handles.append(h)
    return lambda: [lib.ncclCommDeregister(comm, h) for h in handles]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cycles", nargs="?", type=int, default=3)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--resume-first", action="store_true",
                    help="pause and resume the buffers before registering them: a resume backs "
                         "adjacent allocations with one physical allocation, so NCCL registers "
                         "each buffer inside it and the peers map it at a window afterwards")
    ap.add_argument("--torch-hook", action="store_true",
                    help="let torch register the segments (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1)")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    n = args.mib * MIB // 4
    with memsaver.region(TAG, backup="cpu"):
        send = torch.full((n,), float(rank + 1), device="cuda")
        recv = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    result = {"rank": rank, "cycles": [], "failures": []}
    if args.resume_first:
        memsaver.pause(TAG)
        memsaver.resume(TAG)
        send.fill_(0.0)
    deregister = (lambda: None) if args.torch_hook else nccl_register([send, recv])

    def fail(what):
        result["failures"].append(what)

    prev = (rank - 1) % world
    for cycle in range(args.cycles):
        value = float(100 * cycle + rank + 1)
        send.fill_(value)
        exchange(send, recv, rank, world)
        if not bool(torch.all(recv == 100 * cycle + prev + 1).item()):
            fail(f"cycle {cycle}: wrong values received")
        s = memsaver.stats()
        exports = s.shared_exports.get(TAG)
        imports = [i for i in s.shared_imports if i.via == "nccl"]
        if exports is None or exports.importers < 1:
            fail(f"cycle {cycle}: no export of '{TAG}' with an importer: NCCL did not register "
                 f"the buffers through memsaver ({s.shared_exports})")
        if not imports:
            fail(f"cycle {cycle}: no import of a peer's buffer through NCCL ({s.shared_imports})")
        dist.barrier()
        free_before = torch.cuda.mem_get_info()[0]
        memsaver.pause(TAG)
        freed = torch.cuda.mem_get_info()[0] - free_before
        want = 0.9 * 2 * args.mib * MIB
        if freed < want:
            fail(f"cycle {cycle}: pause freed {freed / MIB:.1f} MiB, want >= {want / MIB:.1f}")
        paused_imports = [i.paused for i in memsaver.stats().shared_imports if i.via == "nccl"]
        if not paused_imports or not all(paused_imports):
            fail(f"cycle {cycle}: the peer's buffer is not shown paused: {paused_imports}")
        dist.barrier()
        refused = False
        try:
            dist.all_reduce(send)  # every rank calls it: each refuses, none waits for another
            torch.cuda.synchronize()
        except Exception as e:  # torch raises DistBackendError (a RuntimeError)
            refused = "invalid usage" in str(e)
        if not refused:
            fail(f"cycle {cycle}: an all_reduce of a paused buffer was not refused")
        dist.barrier()
        memsaver.resume(TAG)
        if not bool(torch.all(send == value).item()):
            fail(f"cycle {cycle}: the send buffer's contents did not survive")
        result["cycles"].append({"freed_mib": round(freed / MIB, 1),
                                 "imports": len(imports),
                                 "importers": exports.importers if exports else 0})
    send.fill_(-1.0)
    exchange(send, recv, rank, world)
    if not bool(torch.all(recv == -1.0).item()):
        fail("after the last resume: wrong values received")
    if not args.torch_hook:
        # Deregistration: the peers unmap their imports and tell the owners; a pause then
        # frees the buffers without asking anyone (a peer's mapping still there would hold
        # the memory).
        deregister()
        dist.barrier()
        deadline = time.monotonic() + 10
        while True:
            s = memsaver.stats()
            importers = s.shared_exports[TAG].importers if TAG in s.shared_exports else 0
            imports = [i for i in s.shared_imports if i.via == "nccl"]
            if (importers == 0 and not imports) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if importers or imports:
            fail(f"after deregistration: {importers} importer(s) of '{TAG}', imports {imports}")
        dist.barrier()
        free_before = torch.cuda.mem_get_info()[0]
        memsaver.pause(TAG)
        freed = torch.cuda.mem_get_info()[0] - free_before
        result["freed_after_deregistration_mib"] = round(freed / MIB, 1)
        if freed < 0.9 * 2 * args.mib * MIB:
            fail(f"after deregistration a pause freed {freed / MIB:.1f} MiB")
        memsaver.resume(TAG)
    print("NCCL_REGISTER " + json.dumps(result), flush=True)
    if not args.torch_hook:
        # With torch's hook, torch deregisters the region's segments when their pool goes at
        # exit, on a communicator destroy_process_group has aborted; leave it to the exit.
        dist.destroy_process_group()
    if result["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
