#!/usr/bin/env python3
"""Whether the NUMA node of pinned host memory limits device-to-host copies when every GPU of a
host copies at once (as all ranks' `cpu` backups do in a pause). One process per GPU copies
SIZE_GIB of device memory into pinned host memory placed (a) wherever first touch puts it,
(b) on the GPU's own NUMA node (mbind, from /sys/bus/pci/devices/<gpu>/numa_node), (c) on
another node; first with one GPU alone, then with all GPUs at the same moment. Also prints the
host's topology. Prints GB/s per process and case.

Usage: python3 bench/numa_copy.py [SIZE_GIB, default 4] (torch with CUDA; Linux x86_64).
"""
import ctypes
import multiprocessing as mp
import os
import sys
import time

GIB = 1 << 30
HUGE = 2 << 20
SYS_MBIND = 237  # x86_64
MPOL_BIND = 2


def nodes():
    base = "/sys/devices/system/node"
    return sorted(int(d[4:]) for d in os.listdir(base) if d.startswith("node") and d[4:].isdigit())


def gpu_node(dev):
    import torch

    p = torch.cuda.get_device_properties(dev)
    path = f"/sys/bus/pci/devices/{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0/numa_node"
    try:
        return int(open(path).read())
    except OSError:
        return -1


def worker(dev, size, placement, barrier, out):
    import torch

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.syscall.restype = ctypes.c_long
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]

    torch.cuda.set_device(dev)
    src = torch.ones(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    here = gpu_node(dev)
    all_nodes = nodes()
    node = {"first-touch": None, "local": here, "remote": next((n for n in all_nodes if n != here), None)}[placement]
    p = libc.mmap(None, size + HUGE, 3, 0x22, -1, 0)
    p = (p + HUGE - 1) & ~(HUGE - 1)
    libc.madvise(p, size, 14)  # MADV_HUGEPAGE
    if node is not None and node >= 0:
        mask = ctypes.c_ulong(1 << node)
        rc = libc.syscall(SYS_MBIND, ctypes.c_void_p(p), ctypes.c_size_t(size), MPOL_BIND, ctypes.byref(mask), 65, 0)
        if rc != 0:
            out.put((dev, placement, f"mbind failed errno {ctypes.get_errno()}"))
            return
    libc.memset(p, 0, size)
    assert cuda.cuMemHostRegister_v2(p, size, 0) == 0
    rates = []
    for _ in range(3):
        barrier.wait()
        t = time.perf_counter()
        assert cuda.cuMemcpyDtoH_v2(p, src.data_ptr(), size) == 0
        rates.append(size / (time.perf_counter() - t) / 1e9)
    out.put((dev, placement, f"node {node if node is not None else 'any'} (GPU on {here}): "
                             + " ".join(f"{r:.1f}" for r in rates) + " GB/s"))


def main():
    size = int(float(sys.argv[1]) * GIB) if len(sys.argv) > 1 else 4 * GIB
    import torch

    n = torch.cuda.device_count()
    print(f"numa nodes: {nodes()}; GPU nodes: {[gpu_node(d) for d in range(n)]}; cpus: {os.cpu_count()}")
    ctx = mp.get_context("spawn")
    for placement in ("first-touch", "local", "remote"):
        for devs in ([0], list(range(n))):
            barrier, out = ctx.Barrier(len(devs)), ctx.Queue()
            procs = [ctx.Process(target=worker, args=(d, size, placement, barrier, out)) for d in devs]
            for p in procs:
                p.start()
            rows = sorted(out.get(timeout=300) for _ in procs)
            for p in procs:
                p.join()
            print(f"{placement}, {len(devs)} GPU(s) at once:")
            for dev, _, text in rows:
                print(f"  GPU {dev}: {text}")


if __name__ == "__main__":
    main()
