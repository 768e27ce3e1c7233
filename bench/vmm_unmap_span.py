#!/usr/bin/env python3
"""Whether one cuMemUnmap may span many adjacent mappings of different handles, and what it saves.

A first pause of NCCL's memory unmaps and releases every buffer NCCL made, one 2 MiB handle each,
carved side by side in one reservation. This maps N such handles adjacently in one reservation
(as memsaver's arena holds them) and times three ways to take them down:

  per-mapping   cuMemUnmap of each mapping, then cuMemRelease of its handle (what a pause does)
  spans-of-K    one cuMemUnmap per K adjacent mappings, then a cuMemRelease per handle
  one-span      one cuMemUnmap over all N mappings, then a cuMemRelease per handle
  threads-T     cuMemUnmap of each mapping, then the cuMemReleases split between T threads
                (whether the driver frees memory of one context in parallel)

After each way the range is mapped again and checked with a memset and a copy back, so a
spanning unmap that left something mapped (or unmapped too much) fails the run.

Usage: python3 bench/vmm_unmap_span.py [--n 2576] [--size-mib 2] [--k 64] [--threads 4] [--cycles 3]
Talks to libcuda.so.1 with ctypes (no torch). Prints ms per way (median of the cycles) and
µs per handle. Exits non-zero if a driver call fails, naming it.
"""
import argparse
import ctypes as C
import statistics
import sys
import threading
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from vmm_ops import MIB, Access, Location, Prop, ck, cuda, use_device  # noqa: E402
from vmm_runs import reserve  # noqa: E402


def build(base, n, size, prop, access):
    """Creates n handles and maps them side by side from base; returns the handles."""
    hs = []
    for i in range(n):
        h = C.c_uint64()
        ck("create", cuda.cuMemCreate(C.byref(h), C.c_size_t(size), C.byref(prop), C.c_uint64(0)))
        ck("map", cuda.cuMemMap(C.c_uint64(base + i * size), C.c_size_t(size), C.c_size_t(0), h,
                                C.c_uint64(0)))
        hs.append(h)
    ck("set_access", cuda.cuMemSetAccess(C.c_uint64(base), C.c_size_t(n * size),
                                         C.byref(access), C.c_size_t(1)))
    ck("sync", cuda.cuCtxSynchronize())
    return hs


def check(base, n, size, value):
    """A memset over the whole range and a copy back of the first byte of each mapping."""
    ck("memset", cuda.cuMemsetD8_v2(C.c_uint64(base), C.c_ubyte(value), C.c_size_t(n * size)))
    ck("sync", cuda.cuCtxSynchronize())
    b = C.c_ubyte()
    for i in (0, n // 2, n - 1):
        ck("copy", cuda.cuMemcpyDtoH_v2(C.byref(b), C.c_uint64(base + i * size), C.c_size_t(1)))
        if b.value != value:
            raise SystemExit(f"mapping {i}: read {b.value}, wrote {value}")


def take_down(base, hs, size, span, threads=1):
    """Unmaps in spans of `span` mappings (1: each alone), then releases every handle, from
    `threads` threads (each its share, the context current on each); ms."""
    t = time.perf_counter()
    n = len(hs)
    for i in range(0, n, span):
        m = min(span, n - i)
        ck(f"unmap of {m} mapping(s)",
           cuda.cuMemUnmap(C.c_uint64(base + i * size), C.c_size_t(m * size)))
    if threads == 1:
        for h in hs:
            ck("release", cuda.cuMemRelease(h))
        return (time.perf_counter() - t) * 1e3
    ctx = C.c_void_p()
    ck("ctx", cuda.cuCtxGetCurrent(C.byref(ctx)))
    codes = []

    def release(share):
        # ctypes lets go of the GIL around each call: the releases overlap if the driver lets them.
        cuda.cuCtxSetCurrent(ctx)
        codes.extend(cuda.cuMemRelease(h) for h in share)

    workers = [threading.Thread(target=release, args=(hs[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    ms = (time.perf_counter() - t) * 1e3
    ck("release (threads)", next((c for c in codes if c != 0), 0))
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2576)
    ap.add_argument("--size-mib", type=int, default=2)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=3)
    args = ap.parse_args()
    use_device(0)
    # POSIX-fd handles, as NCCL makes them for its peers.
    prop = Prop(type=1, requestedHandleTypes=1, location=Location(1, 0))
    access = Access(Location(1, 0), 3)
    size = args.size_mib * MIB
    r, base = reserve(args.n * size)
    ck("reserve", r)
    ways = [("per-mapping", 1, 1), (f"spans-of-{args.k}", args.k, 1), ("one-span", args.n, 1),
            (f"threads-{args.threads}", 1, args.threads)]
    times = {name: [] for name, _, _ in ways}
    for cycle in range(args.cycles):
        for v, (name, span, threads) in enumerate(ways):
            hs = build(base, args.n, size, prop, access)
            check(base, args.n, size, (cycle * 4 + v) % 251 + 1)
            times[name].append(take_down(base, hs, size, span, threads))
    print(f"{args.n} handles of {args.size_mib} MiB side by side in one reservation, "
          f"median of {args.cycles} cycles")
    print(f"{'way':<16} {'ms':>9} {'µs/handle':>10}")
    for name, _, _ in ways:
        ms = statistics.median(times[name])
        print(f"{name:<16} {ms:9.2f} {ms * 1e3 / args.n:10.1f}")
    ck("free", cuda.cuMemAddressFree(C.c_uint64(base), C.c_size_t(args.n * size)))
    print("VMM_UNMAP_SPAN PASS: a cuMemUnmap spanning adjacent mappings of different handles "
          "succeeds, and the range maps again")


if __name__ == "__main__":
    main()
