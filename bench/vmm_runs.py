#!/usr/bin/env python3
"""What backing a run of adjacent allocations with one physical allocation would save.

A tag of N allocations of SIZE each costs N x (create, map, set_access) to resume and
N x (unmap, release) to pause, because every allocation has its own physical handle (cuMemMap
takes no offset into a handle). If the N allocations were adjacent in one reservation, one
handle of N x SIZE could back them all: one call of each kind. This measures both, for the same
bytes, and whether the driver lets one mapping span two adjacent reservations (which would
allow merging without address arenas).

Usage: python3 bench/vmm_runs.py [--n 256] [--size-mib 64] [--cycles 5]
Talks to libcuda.so.1 with ctypes (no torch). Prints ms per pause and resume of each layout.
Exits non-zero if a driver call that must succeed fails.
"""
import argparse
import ctypes as C
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from vmm_ops import MIB, Access, Location, Prop, ck, cuda, use_device  # noqa: E402


def reserve(size, addr=0):
    p = C.c_uint64()
    r = cuda.cuMemAddressReserve(C.byref(p), C.c_size_t(size), C.c_size_t(0), C.c_uint64(addr),
                                 C.c_uint64(0))
    return r, p.value


def cycle(ranges, prop, access):
    """Resume then pause `ranges` (va, size), one handle each; returns (resume ms, pause ms)."""
    t = time.perf_counter()
    hs = []
    for va, size in ranges:
        h = C.c_uint64()
        ck("create", cuda.cuMemCreate(C.byref(h), C.c_size_t(size), C.byref(prop), C.c_uint64(0)))
        ck("map", cuda.cuMemMap(C.c_uint64(va), C.c_size_t(size), C.c_size_t(0), h, C.c_uint64(0)))
        ck("access", cuda.cuMemSetAccess(C.c_uint64(va), C.c_size_t(size), C.byref(access),
                                         C.c_size_t(1)))
        hs.append(h)
    ck("sync", cuda.cuCtxSynchronize())
    resume = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    for (va, size), h in zip(ranges, hs, strict=True):
        ck("unmap", cuda.cuMemUnmap(C.c_uint64(va), C.c_size_t(size)))
        ck("release", cuda.cuMemRelease(h))
    pause = (time.perf_counter() - t) * 1e3
    return resume, pause


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--cycles", type=int, default=5)
    args = ap.parse_args()
    use_device(0)
    prop = Prop(type=1, requestedHandleTypes=0, location=Location(1, 0))
    access = Access(Location(1, 0), 3)
    size = args.size_mib * MIB
    total = args.n * size

    r, base = reserve(total)
    ck("reserve", r)
    layouts = {
        f"{args.n} x {args.size_mib} MiB, a handle each": [(base + i * size, size) for i in range(args.n)],
        f"{total // (1 << 30)} GiB as 1 GiB handles": [(base + i * (1 << 30), 1 << 30)
                                                      for i in range(total // (1 << 30))],
        "the same bytes as one handle": [(base, total)],
    }
    print(f"{'layout':<36}{'resume ms':>12}{'pause ms':>12}   (median of {args.cycles}, after 1 warm-up)")
    for name, ranges in layouts.items():
        cycle(ranges, prop, access)
        times = [cycle(ranges, prop, access) for _ in range(args.cycles)]
        print(f"{name:<36}{statistics.median(t[0] for t in times):>12.2f}"
              f"{statistics.median(t[1] for t in times):>12.2f}")
    ck("free", cuda.cuMemAddressFree(C.c_uint64(base), C.c_size_t(total)))

    # Can one mapping span two adjacent reservations?
    r1, a = reserve(size)
    r2, b = reserve(size, a + size)
    ck("reserve", r1)
    ck("reserve", r2)
    if b != a + size:
        print(f"spanning two reservations: not tried (the driver placed the second at {b:#x}, "
              f"not {a + size:#x})")
    else:
        h = C.c_uint64()
        ck("create", cuda.cuMemCreate(C.byref(h), C.c_size_t(2 * size), C.byref(prop), C.c_uint64(0)))
        r = cuda.cuMemMap(C.c_uint64(a), C.c_size_t(2 * size), C.c_size_t(0), h, C.c_uint64(0))
        name = C.c_char_p()
        cuda.cuGetErrorName(r, C.byref(name))
        print(f"one mapping over two adjacent reservations: {name.value.decode() if name.value else r}")
        if r == 0:
            ck("unmap", cuda.cuMemUnmap(C.c_uint64(a), C.c_size_t(2 * size)))
        ck("release", cuda.cuMemRelease(h))
    cuda.cuMemAddressFree(C.c_uint64(a), C.c_size_t(size))
    cuda.cuMemAddressFree(C.c_uint64(b), C.c_size_t(size))


if __name__ == "__main__":
    main()
