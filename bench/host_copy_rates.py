#!/usr/bin/env python3
"""What the host allows a first pause whose backup is not pinned yet: how fast fresh host memory
faults in (small pages, and transparent huge pages with MADV_HUGEPAGE), how fast the driver
copies device memory into pageable memory (faulted in, or fresh) from 1, 4 and 8 threads, and
how fast memmove fills fresh memory, against a copy into pinned memory. 2 GiB each, device 0.

Usage: python3 bench/host_copy_rates.py (torch with CUDA; prints GB/s per case).
"""
import ctypes
import threading
import time

import torch

GIB = 1 << 30
N = 2 * GIB
HUGE = 2 << 20
MADV_HUGEPAGE = 14

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]


def region(huge):
    """N bytes of fresh anonymous memory, 2 MiB aligned, advised MADV_HUGEPAGE if `huge`."""
    p = libc.mmap(None, N + HUGE, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    p = (p + HUGE - 1) & ~(HUGE - 1)
    if huge:
        libc.madvise(p, N, MADV_HUGEPAGE)
    return p


def parallel(fn, threads):
    """GB/s of `fn(offset, length)` over N bytes split between `threads` threads."""
    step = N // threads
    ts = [threading.Thread(target=fn, args=(i * step, step)) for i in range(threads)]
    t = time.perf_counter()
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    return N / (time.perf_counter() - t) / 1e9


def main():
    thp = "/sys/kernel/mm/transparent_hugepage/"
    enabled, defrag = (open(thp + f).read().strip() for f in ("enabled", "defrag"))
    print("transparent huge pages:", enabled, "defrag:", defrag)
    dev = torch.empty(N, dtype=torch.uint8, device="cuda").fill_(7)
    torch.cuda.synchronize()
    src = dev.data_ptr()

    def fill(dst):
        return lambda off, n: libc.memset(dst + off, 0, n)

    def move(dst, from_):
        return lambda off, n: libc.memmove(dst + off, from_ + off, n)

    def d2h(dst):
        def run(off, n):
            torch.cuda.set_device(0)  # the primary context current on this thread
            cuda.cuMemcpyDtoH_v2(dst + off, src + off, n)
        return run

    for huge in (False, True):
        for threads in (1, 4, 8):
            p, q, r = region(huge), region(huge), region(huge)
            print(f"touch huge={huge} threads={threads}: {parallel(fill(p), threads):.1f} GB/s")
            print(f"  D2H into touched pageable, threads={threads}: {parallel(d2h(p), threads):.1f} GB/s")
            print(f"  D2H into fresh pageable, threads={threads}: {parallel(d2h(q), threads):.1f} GB/s")
            print(f"  memmove into fresh, threads={threads}: {parallel(move(r, p), threads):.1f} GB/s")
            for x in (p, q, r):
                libc.munmap(x, N)
    pinned = torch.empty(N, dtype=torch.uint8, pin_memory=True)
    t = time.perf_counter()
    pinned.copy_(dev)
    torch.cuda.synchronize()
    print(f"D2H pinned: {N / (time.perf_counter() - t) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
