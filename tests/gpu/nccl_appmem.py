#!/usr/bin/env python3
"""GPU check: memory the application takes from ``ncclMemAlloc`` keeps every byte (2 GPUs).

Run with torchrun, one process per GPU, under the preload:

    LD_PRELOAD=$(python3 -m memsaver preload-path) NCCL_NVLS_ENABLE=0 \\
        torchrun --nproc-per-node 2 tests/gpu/nccl_appmem.py [CYCLES]

(``tests/gpu/nccl_appmem.sh`` runs it on torch's NCCL and on NCCL 2.30.7 built from source.)

Each rank makes, then checks over CYCLES cycles of ``pause``/``resume``:

* ``plain``: 16 MiB from ``ncclMemAlloc`` outside any region (ctypes on the libnccl torch
  loaded): resident, untouched by ``pause("nccl")``;
* ``registered``: 16 MiB from ``ncclMemAlloc`` inside ``region("weights", backup="cpu")``,
  registered with ``ncclCommRegister`` on torch's communicator and all-reduced;
* ``window``: 16 MiB from ``ncclMemAlloc`` inside ``region("symm", backup="cpu")``, registered
  with ``ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC)`` (NCCL >= 2.27) and all-reduced;
* ``pool``: tensors from ``torch.cuda.MemPool(backend.mem_allocator)`` inside
  ``region("weights")``, the pool registered with ``register_mem_pool``, all-reduced, and an
  all-reduce of them captured in a CUDA graph and replayed;
* ``symm``: torch's symmetric memory on the NCCL backend (``symm_mem.empty``,
  ``rendezvous``) inside ``region("symm")``, all-reduced.

Per cycle every rank pauses ``nccl``, ``weights`` and ``symm`` (junk written over the freed
memory by a scratch tensor of the same size, as a rollout engine would), resumes them, and
checks that each buffer holds exactly what it held, that the collectives on it are exact, and
that ``pause`` gave the tagged bytes back to the device. Exit status non-zero on any failure;
one ``NCCL_APPMEM {json}`` line per rank.
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
SIZE = 16 * MIB
NCCL_FLOAT32 = 7
NCCL_SUM = 0
NCCL_WIN_COLL_SYMMETRIC = 1


def libnccl():
    """The libnccl torch's communicators come from: the one preloaded, else torch's."""
    for path in os.environ.get("LD_PRELOAD", "").split():
        if "libnccl" in os.path.basename(path):
            return ctypes.CDLL(path)
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libnccl.so" in line}
    if not paths:
        raise RuntimeError("no libnccl.so loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


class Raw:
    """A device buffer as torch sees it (``__cuda_array_interface__``), float32."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes // 4,), "typestr": "<f4", "data": (ptr, False), "version": 2}


def as_tensor(ptr, nbytes):
    return torch.as_tensor(Raw(ptr, nbytes), device="cuda")


class Nccl:
    def __init__(self):
        self.lib = lib = libnccl()
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
        self.backend = backend
        self.comm = ctypes.c_void_p(backend._comm_ptr())
        P, S = ctypes.c_void_p, ctypes.c_size_t
        lib.ncclMemAlloc.argtypes = [ctypes.POINTER(P), S]
        lib.ncclMemFree.argtypes = [P]
        lib.ncclCommRegister.argtypes = [P, P, S, ctypes.POINTER(P)]
        lib.ncclCommDeregister.argtypes = [P, P]
        lib.ncclAllReduce.argtypes = [P, P, S, ctypes.c_int, ctypes.c_int, P, P]
        self.has_window = hasattr(lib, "ncclCommWindowRegister")
        if self.has_window:
            lib.ncclCommWindowRegister.argtypes = [P, P, S, ctypes.POINTER(P), ctypes.c_int]
            lib.ncclCommWindowDeregister.argtypes = [P, P]

    def check(self, what, rc):
        if rc != 0:
            raise RuntimeError(f"{what} returned {rc}")

    def mem_alloc(self, nbytes):
        p = ctypes.c_void_p()
        self.check("ncclMemAlloc", self.lib.ncclMemAlloc(ctypes.byref(p), nbytes))
        return p.value

    def register(self, ptr, nbytes):
        h = ctypes.c_void_p()
        self.check("ncclCommRegister",
                   self.lib.ncclCommRegister(self.comm, ptr, nbytes, ctypes.byref(h)))
        return h

    def window(self, ptr, nbytes):
        w = ctypes.c_void_p()
        self.check("ncclCommWindowRegister", self.lib.ncclCommWindowRegister(
            self.comm, ptr, nbytes, ctypes.byref(w), NCCL_WIN_COLL_SYMMETRIC))
        return w

    def all_reduce(self, t):
        """In-place sum on the raw pointer, on torch's current stream."""
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.check("ncclAllReduce", self.lib.ncclAllReduce(
            t.data_ptr(), t.data_ptr(), t.numel(), NCCL_FLOAT32, NCCL_SUM, self.comm, stream))
        torch.cuda.synchronize()


def seed_values(t, rank, salt):
    """Exactly representable values: an all-reduce of these over the ranks is exact."""
    n = t.numel()
    v = (torch.arange(n, device="cuda", dtype=torch.int64) * 7 + rank * 13 + salt) % 1024
    t.copy_(v.to(torch.float32))


def expected(n, world, salt):
    idx = torch.arange(n, device="cuda", dtype=torch.int64)
    return sum(((idx * 7 + r * 13 + salt) % 1024).to(torch.float32) for r in range(world))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cycles", nargs="?", type=int, default=3)
    ap.add_argument("--symm-optional", action="store_true",
                    help="a symmetric-memory set-up that fails (before any pause) is reported, "
                         "not a failure: torch 2.11's NCCL symmetric memory fails on NCCL 2.30.7 "
                         "without memsaver too (ncclDevCommCreate: invalid usage)")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    # NCCL's communicator exists once a collective ran.
    dist.all_reduce(torch.ones(1, device=dev))
    nccl = Nccl()
    fails = []
    report = {"rank": rank, "nccl_version": torch.cuda.nccl.version(),
              "window": nccl.has_window, "cycles": []}

    def check(name, ok, detail=""):
        if not ok:
            fails.append(f"{name}: {detail}")

    bufs = {}  # name -> (tensor, salt of its expected contents, reduced?)
    # plain: untagged, resident.
    p = nccl.mem_alloc(SIZE)
    bufs["plain"] = as_tensor(p, SIZE)
    seed_values(bufs["plain"], rank, 1)
    # registered: tag weights, registered, all-reduced.
    with memsaver.region("weights", backup="cpu"):
        p = nccl.mem_alloc(SIZE)
    bufs["registered"] = as_tensor(p, SIZE)
    reg_handle = nccl.register(p, SIZE)
    seed_values(bufs["registered"], rank, 2)
    nccl.all_reduce(bufs["registered"])
    # window: tag symm, window-registered, all-reduced.
    win = None
    if nccl.has_window:
        with memsaver.region("symm", backup="cpu"):
            p = nccl.mem_alloc(SIZE)
        bufs["window"] = as_tensor(p, SIZE)
        win = nccl.window(p, SIZE)
        seed_values(bufs["window"], rank, 3)
        nccl.all_reduce(bufs["window"])
    # pool: torch's NCCL memory pool in the region, registered, and a graph of its all-reduce.
    graph = graph_buf = None
    pool_error = None
    try:
        with memsaver.region("weights", backup="cpu"):
            pool = torch.cuda.MemPool(nccl.backend.mem_allocator)
            with torch.cuda.use_mem_pool(pool):
                bufs["pool"] = torch.empty(SIZE // 4, device=dev)
                graph_buf = torch.empty(SIZE // 4, device=dev)
        nccl.backend.register_mem_pool(pool)
        seed_values(bufs["pool"], rank, 4)
        dist.all_reduce(bufs["pool"])
        seed_values(graph_buf, rank, 5)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(graph_buf)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        seed_values(graph_buf, rank, 5)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dist.all_reduce(graph_buf)
    except RuntimeError as e:
        # This torch build has no NCCL memory pool: said, not a failure of memsaver's.
        if "not supported" not in str(e):
            raise
        pool_error = str(e)
        bufs.pop("pool", None)
    # symm: torch's symmetric memory on the NCCL backend.
    symm_error = None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.set_backend("NCCL")
        with memsaver.region("symm", backup="cpu"):
            bufs["symm"] = symm_mem.empty(SIZE // 4, device=dev)
        symm_mem.rendezvous(bufs["symm"], dist.group.WORLD.group_name)
        seed_values(bufs["symm"], rank, 6)
        dist.all_reduce(bufs["symm"])
    except Exception as e:  # reported; a failure unless --symm-optional
        symm_error = f"{type(e).__name__}: {e}"
        bufs.pop("symm", None)
        if not args.symm_optional:
            fails.append(f"symmetric memory on the NCCL backend: {symm_error}")
    torch.cuda.synchronize()

    salts = {"plain": 1, "registered": 2, "window": 3, "pool": 4, "symm": 6}
    reduced = {"registered", "window", "pool", "symm"}
    truth = {}
    for name, t in bufs.items():
        want = expected(t.numel(), world, salts[name]) if name in reduced else None
        if want is None:
            want = t.clone()
        check(f"{name} before any pause", torch.equal(t, want), "wrong contents")
        truth[name] = want
    if graph is not None:
        graph.replay()
        torch.cuda.synchronize()
        check("graph before any pause",
              torch.equal(graph_buf, expected(graph_buf.numel(), world, 5)), "wrong contents")

    report["application"] = dict(memsaver.nccl_stats())["application"]
    paused_tags = ["symm", "weights", "nccl"] if ("window" in bufs or "symm" in bufs) \
        else ["weights", "nccl"]
    for cycle in range(args.cycles):
        dist.barrier()
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        memsaver.pause(*paused_tags)
        t1 = time.perf_counter()
        free1 = torch.cuda.mem_get_info()[0]
        # Junk over the freed memory, as another engine would write.
        junk = torch.full(((free1 - free0) // 2 // 4,), 3.25e7, device=dev) \
            if free1 > free0 else None
        torch.cuda.synchronize()
        del junk
        torch.cuda.empty_cache()
        # The untagged buffer is resident and usable while paused.
        check(f"cycle {cycle}: plain while paused", torch.equal(bufs["plain"], truth["plain"]))
        t2 = time.perf_counter()
        memsaver.resume(*reversed(paused_tags))
        t3 = time.perf_counter()
        for name, t in bufs.items():
            check(f"cycle {cycle}: {name} after resume", torch.equal(t, truth[name]),
                  "contents differ")
        # Collectives on the buffers after the resume are exact.
        for name in sorted(reduced & set(bufs)):
            t = bufs[name]
            seed_values(t, rank, salts[name] + 10 * (cycle + 1))
            if name in ("registered", "window"):
                nccl.all_reduce(t)
            else:
                dist.all_reduce(t)
            torch.cuda.synchronize()
            truth[name] = expected(t.numel(), world, salts[name] + 10 * (cycle + 1))
            check(f"cycle {cycle}: all_reduce on {name}", torch.equal(t, truth[name]), "wrong")
        if graph is not None:
            seed_values(graph_buf, rank, 5)
            graph.replay()
            torch.cuda.synchronize()
            check(f"cycle {cycle}: graph replay",
                  torch.equal(graph_buf, expected(graph_buf.numel(), world, 5)), "wrong")
        report["cycles"].append({"pause_ms": round((t1 - t0) * 1e3, 1),
                                 "resume_ms": round((t3 - t2) * 1e3, 1),
                                 "freed_mib": round((free1 - free0) / MIB)})
    # Tagged memory (registered + window/symm + pool, each >= 16 MiB) came back to the device.
    min_freed = min(c["freed_mib"] for c in report["cycles"]) if report["cycles"] else 0
    tagged = sum(1 for n in bufs if n != "plain")
    check("pause frees the tagged buffers", min_freed >= tagged * 16,
          f"only {min_freed} MiB freed for {tagged} tagged buffers of 16 MiB")
    # Teardown through NCCL.
    dist.barrier()
    if win is not None:
        nccl.check("ncclCommWindowDeregister", nccl.lib.ncclCommWindowDeregister(nccl.comm, win))
    nccl.check("ncclCommDeregister", nccl.lib.ncclCommDeregister(nccl.comm, reg_handle))
    report["symm_error"] = symm_error
    report["pool_error"] = pool_error
    report["fails"] = fails
    print("NCCL_APPMEM " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
