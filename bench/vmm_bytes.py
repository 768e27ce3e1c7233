#!/usr/bin/env python3
"""What the driver costs per byte when a pause frees memory and a resume brings it back.

A pause of NCCL's memory at 16 communicators frees 10-15 GB per rank, and its resume creates,
maps, grants and zero-fills as much again. This times each of those steps for TOTAL GiB laid out
side by side in one reservation, in pieces of SIZE MiB each (one physical allocation per piece),
so the cost per byte and the cost per allocation can be told apart:

  create        cuMemCreate of every piece
  map+grant     cuMemMap of every piece, then one cuMemSetAccess over the whole range
  fill-d8       cuMemsetD8Async of the whole range, then a synchronize (what a resume queues)
  fill-d32      cuMemsetD32Async of the whole range (4-byte words), then a synchronize
  fill-d8-again the same as fill-d8 on memory filled before
  unmap         cuMemUnmap of the whole range
  release       cuMemRelease of every piece

It also reports what fresh memory holds: every piece is filled with 0xAB before it is released,
and the next cycle samples its fresh memory before filling it (informative: nothing documents
that fresh memory is zero, so memsaver zero-fills what no backup restores).

With --procs P, P processes on the same GPU run every step at once (a barrier before each), as
the ranks of a job pause and resume together; the times are then the slowest process's, which
shows whether the driver does the processes' work side by side or one after the other.

Usage: python3 bench/vmm_bytes.py [--total-gib 10] [--sizes 2,64,1024] [--cycles 3] [--procs 1]
Talks to libcuda.so.1 with ctypes (no torch). Prints ms per step (median of the cycles after the
first) and GB/s for the fills. Exits non-zero if a driver call fails, naming it.
"""
import argparse
import ctypes as C
import multiprocessing as mp
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from vmm_ops import MIB, Access, Location, Prop, ck, cuda, use_device  # noqa: E402
from vmm_runs import reserve  # noqa: E402

STEPS = ("create", "map+grant", "fill-d8", "fill-d32", "fill-d8-again", "unmap", "release")
SAMPLES = 64  # bytes read back per piece, at its start, middle and end


def ms_since(t):
    return (time.perf_counter() - t) * 1e3


def fresh_nonzero(base, n, size):
    """How many of the sampled bytes of fresh memory are not zero."""
    buf = (C.c_ubyte * SAMPLES)()
    nonzero = 0
    for i in range(n):
        for off in (0, size // 2, size - SAMPLES):
            ck("copy back", cuda.cuMemcpyDtoH_v2(buf, C.c_uint64(base + i * size + off),
                                                 C.c_size_t(SAMPLES)))
            nonzero += sum(1 for b in buf if b)
    return nonzero, n * 3 * SAMPLES


def one_cycle(base, n, size, prop, access, together=None):
    """One cycle; `together` (a barrier shared with other processes, or None) is waited on
    before each timed step."""
    def start():
        if together is not None:
            ck("sync", cuda.cuCtxSynchronize())
            together.wait()
        return time.perf_counter()

    t, hs = {}, []
    s = start()
    for _ in range(n):
        h = C.c_uint64()
        ck("create", cuda.cuMemCreate(C.byref(h), C.c_size_t(size), C.byref(prop), C.c_uint64(0)))
        hs.append(h)
    t["create"] = ms_since(s)
    s = start()
    for i, h in enumerate(hs):
        ck("map", cuda.cuMemMap(C.c_uint64(base + i * size), C.c_size_t(size), C.c_size_t(0), h,
                                C.c_uint64(0)))
    ck("set_access", cuda.cuMemSetAccess(C.c_uint64(base), C.c_size_t(n * size),
                                         C.byref(access), C.c_size_t(1)))
    t["map+grant"] = ms_since(s)
    fresh = fresh_nonzero(base, n, size)
    total = n * size
    for step, fill in (("fill-d8", lambda: cuda.cuMemsetD8Async(
                            C.c_uint64(base), C.c_ubyte(0), C.c_size_t(total), None)),
                       ("fill-d32", lambda: cuda.cuMemsetD32Async(
                            C.c_uint64(base), C.c_uint(0), C.c_size_t(total // 4), None)),
                       ("fill-d8-again", lambda: cuda.cuMemsetD8Async(
                            C.c_uint64(base), C.c_ubyte(0), C.c_size_t(total), None))):
        ck("sync", cuda.cuCtxSynchronize())
        s = start()
        ck(step, fill())
        ck("sync", cuda.cuCtxSynchronize())
        t[step] = ms_since(s)
    # What the next cycle's fresh memory would hold if the driver handed these bytes back as is.
    ck("fill 0xAB", cuda.cuMemsetD8_v2(C.c_uint64(base), C.c_ubyte(0xAB), C.c_size_t(total)))
    ck("sync", cuda.cuCtxSynchronize())
    s = start()
    ck("unmap", cuda.cuMemUnmap(C.c_uint64(base), C.c_size_t(total)))
    t["unmap"] = ms_since(s)
    s = start()
    for h in hs:
        ck("release", cuda.cuMemRelease(h))
    t["release"] = ms_since(s)
    return t, fresh


def worker(args, together, results):
    """Runs every size's cycles in this process; puts {size: (times per cycle, fresh bytes)}."""
    use_device(0)
    prop = Prop(type=1, requestedHandleTypes=1, location=Location(1, 0))
    access = Access(Location(1, 0), 3)
    total = args.total_gib << 30
    r, base = reserve(total)
    ck("reserve", r)
    out = {}
    for size_mib in args.sizes:
        size = size_mib * MIB
        n = total // size
        runs, fresh = [], (0, 0)
        for cycle in range(args.cycles):
            t, f = one_cycle(base, n, size, prop, access, together)
            runs.append(t)
            if cycle > 0:
                fresh = (fresh[0] + f[0], fresh[1] + f[1])
        out[size_mib] = (runs, fresh)
    ck("free", cuda.cuMemAddressFree(C.c_uint64(base), C.c_size_t(total)))
    results.put(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-gib", type=int, default=10)
    ap.add_argument("--sizes", default="2,64,1024", help="piece sizes in MiB, comma-separated")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--procs", type=int, default=1)
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    together = ctx.Barrier(args.procs) if args.procs > 1 else None
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(args, together, results))
             for _ in range(args.procs)]
    for p in procs:
        p.start()
    outs = [results.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a process exited with {p.exitcode}")
    total = args.total_gib << 30
    print(f"{args.total_gib} GiB side by side in one reservation, in each of {args.procs} "
          f"process(es) on GPU 0; ms (the slowest process), median of cycles 2-{args.cycles}")
    print(f"{'piece MiB':>9} {'pieces':>6} " + " ".join(f"{s:>13}" for s in STEPS)
          + f" {'fill GB/s':>9} {'fresh nonzero':>14}")
    for size_mib in args.sizes:
        per_cycle = [{k: max(o[size_mib][0][c][k] for o in outs) for k in STEPS}
                     for c in range(args.cycles)]
        kept = per_cycle[1:] or per_cycle
        med = {k: statistics.median(t[k] for t in kept) for k in STEPS}
        fresh = (sum(o[size_mib][1][0] for o in outs), sum(o[size_mib][1][1] for o in outs))
        gbs = args.procs * total / 1e9 / (med["fill-d8"] / 1e3)
        print(f"{size_mib:>9} {total // (size_mib * MIB):>6} "
              + " ".join(f"{med[s]:13.2f}" for s in STEPS)
              + f" {gbs:9.0f} {fresh[0]:>6}/{fresh[1]:<7}")
    print("VMM_BYTES PASS")


if __name__ == "__main__":
    main()
