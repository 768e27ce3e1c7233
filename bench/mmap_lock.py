#!/usr/bin/env python3
"""Does faulting in host memory on one thread hold up another thread's mmap/munmap?

A background thread maps TOTAL bytes in STEP-sized MAP_FIXED mappings inside one reservation
and faults each in, either with MAP_POPULATE ("populate": the kernel faults the pages in under
the process's mmap lock) or by writing to every page ("touch": each fault takes only its own
area's lock on kernels with per-VMA locks, 6.4+). Meanwhile the main thread maps and unmaps
1 GiB of address space in a loop, as a driver does for device memory, and the longest and the
99th percentile of those calls are printed. No GPU needed.

Usage: python3 bench/mmap_lock.py [--total-mib 2048] [--step-mib 16]
"""
import argparse
import ctypes as C
import threading
import time

libc = C.CDLL(None, use_errno=True)
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
libc.munmap.argtypes = [C.c_void_p, C.c_size_t]
libc.memset.argtypes = [C.c_void_p, C.c_int, C.c_size_t]
MIB = 1 << 20
PROT_RW, PRIVATE, ANON, FIXED, NORESERVE, POPULATE = 3, 0x02, 0x20, 0x10, 0x4000, 0x8000


def case(mode, total, step):
    done = threading.Event()
    out = []

    def background():
        base = libc.mmap(None, total, 0, PRIVATE | ANON | NORESERVE, -1, 0)
        for off in range(0, total, step):
            flags = PRIVATE | ANON | FIXED | (POPULATE if mode == "populate" else 0)
            libc.mmap(base + off, step, PROT_RW, flags, -1, 0)
            if mode == "touch":
                libc.memset(base + off, 0, step)  # the GIL is released meanwhile
        done.set()
        return base

    t = threading.Thread(target=lambda: out.append(background()))

    t.start()
    lat = []
    while not done.is_set():
        s = time.perf_counter()
        p = libc.mmap(None, 1 << 30, 0, PRIVATE | ANON | NORESERVE, -1, 0)
        libc.munmap(p, 1 << 30)
        lat.append((time.perf_counter() - s) * 1e3)
    t.join()
    libc.munmap(out[0], total)
    lat.sort()
    print(f"{mode:<9} {len(lat):>8} {lat[-1]:>9.2f} {lat[int(0.99 * len(lat))]:>8.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mib", type=int, default=2048)
    ap.add_argument("--step-mib", type=int, default=16)
    args = ap.parse_args()
    print(f"{'fault by':<9} {'mmaps':>8} {'max ms':>9} {'p99 ms':>8}")
    for mode in ("populate", "touch"):
        case(mode, args.total_mib * MIB, args.step_mib * MIB)


if __name__ == "__main__":
    main()
