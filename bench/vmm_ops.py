#!/usr/bin/env python3
"""What each CUDA VMM call costs, for the shapes NCCL's memory has (issue 4).

Pausing NCCL's memory is ~1000 small VMM allocations per process; this measures, per call,
cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap / cuMemRelease / cuMemExportToShareableHandle
for N allocations of SIZE each (each in its own reservation, as NCCL does), with and without a
POSIX-fd handle type and with access for one or all visible devices, and the cost of exporting
each handle as a POSIX fd (first and second time) and importing it back. (cuMemMap at a non-zero
offset into one large handle would save calls, but the driver refuses it: NOT_SUPPORTED.)

Usage: python3 bench/vmm_ops.py [--n 1000] [--size-mib 2]
Talks to libcuda.so.1 with ctypes (no torch). Prints a table of microseconds per call.
Exits non-zero if a driver call fails.
"""
import argparse
import ctypes as C
import os
import statistics
import sys
import time

cuda = C.CDLL("libcuda.so.1")
MIB = 1 << 20


class Location(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class AllocFlags(C.Structure):
    _fields_ = [("compressionType", C.c_ubyte), ("gpuDirectRDMACapable", C.c_ubyte),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("requestedHandleTypes", C.c_int), ("location", Location),
                ("win32HandleMetaData", C.c_void_p), ("allocFlags", AllocFlags)]


class Access(C.Structure):
    _fields_ = [("location", Location), ("flags", C.c_int)]


def ck(name, r):
    if r != 0:
        s = C.c_char_p()
        cuda.cuGetErrorName(r, C.byref(s))
        raise SystemExit(f"{name} failed: {s.value.decode() if s.value else r}")


def use_device(ordinal=0):
    """Initialises the driver and makes device `ordinal`'s primary context current."""
    ck("init", cuda.cuInit(0))
    dev, ctx = C.c_int(), C.c_void_p()
    ck("device", cuda.cuDeviceGet(C.byref(dev), ordinal))
    ck("ctx", cuda.cuDevicePrimaryCtxRetain(C.byref(ctx), dev))
    ck("set ctx", cuda.cuCtxSetCurrent(ctx))


def timed(samples, f, *args):
    t = time.perf_counter_ns()
    r = f(*args)
    samples.append((time.perf_counter_ns() - t) / 1e3)
    return r


def run_case(n, size, fd_handles, devices):
    prop = Prop(type=1, requestedHandleTypes=1 if fd_handles else 0, location=Location(1, 0))
    access = (Access * len(devices))(*[Access(Location(1, d), 3) for d in devices])
    gran = C.c_size_t()
    ck("granularity", cuda.cuMemGetAllocationGranularity(C.byref(gran), C.byref(prop), 0))
    size = (size + gran.value - 1) // gran.value * gran.value
    vas = []
    for _ in range(n):
        p = C.c_uint64()
        ck("reserve", cuda.cuMemAddressReserve(C.byref(p), C.c_size_t(size), C.c_size_t(0),
                                               C.c_uint64(0), C.c_uint64(0)))
        vas.append(p.value)
    t = {k: [] for k in ("create", "map", "set_access", "export_fd", "import_fd",
                          "close_fd", "export_again", "close_again", "unmap", "release")}
    for cycle in range(3):  # the first cycle warms up; the last two are kept
        keep = cycle > 0
        s = {k: [] for k in t}
        hs = []
        for va in vas:
            h = C.c_uint64()
            ck("create", timed(s["create"], cuda.cuMemCreate, C.byref(h), C.c_size_t(size),
                               C.byref(prop), C.c_uint64(0)))
            hs.append(h.value)
            ck("map", timed(s["map"], cuda.cuMemMap, C.c_uint64(va), C.c_size_t(size),
                            C.c_size_t(0), C.c_uint64(hs[-1]), C.c_uint64(0)))
            ck("access", timed(s["set_access"], cuda.cuMemSetAccess, C.c_uint64(va),
                               C.c_size_t(size), access, C.c_size_t(len(devices))))
        if fd_handles:
            for key in ("export_fd", "export_again"):
                fds = []
                for h in hs:
                    fd = C.c_int()
                    ck("export", timed(s[key], cuda.cuMemExportToShareableHandle,
                                       C.byref(fd), C.c_uint64(h), 1, C.c_uint64(0)))
                    fds.append(fd.value)
                if key == "export_fd":
                    for fd in fds:
                        h = C.c_uint64()
                        ck("import", timed(s["import_fd"], cuda.cuMemImportFromShareableHandle,
                                           C.byref(h), C.c_void_p(fd), 1))
                        ck("release import", cuda.cuMemRelease(h))
                for fd in fds:
                    timed(s["close_fd" if key == "export_fd" else "close_again"], os.close, fd)
        ck("sync", cuda.cuCtxSynchronize())
        for va in vas:
            ck("unmap", timed(s["unmap"], cuda.cuMemUnmap, C.c_uint64(va), C.c_size_t(size)))
        for h in hs:
            ck("release", timed(s["release"], cuda.cuMemRelease, C.c_uint64(h)))
        if keep:
            for k in t:
                t[k] += s[k]
    for va in vas:
        ck("free", cuda.cuMemAddressFree(C.c_uint64(va), C.c_size_t(size)))
    return {k: (statistics.median(v), sum(v) / 2 / 1e3) for k, v in t.items() if v}


def export_threads(n, size, threads):
    """Wall ms to export n fresh handles from `threads` threads (does the driver serialise?)."""
    from concurrent.futures import ThreadPoolExecutor
    prop = Prop(type=1, requestedHandleTypes=1, location=Location(1, 0))
    hs = []
    for _ in range(n):
        h = C.c_uint64()
        ck("create", cuda.cuMemCreate(C.byref(h), C.c_size_t(size), C.byref(prop), C.c_uint64(0)))
        hs.append(h.value)
    ctx = C.c_void_p()
    ck("ctx", cuda.cuCtxGetCurrent(C.byref(ctx)))

    def export(chunk):
        ck("set ctx", cuda.cuCtxSetCurrent(ctx))
        for h in chunk:
            fd = C.c_int()
            ck("export", cuda.cuMemExportToShareableHandle(C.byref(fd), C.c_uint64(h), 1,
                                                           C.c_uint64(0)))
            os.close(fd.value)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(export, [hs[i::threads] for i in range(threads)]))
    ms = (time.perf_counter() - t) * 1e3
    for h in hs:
        ck("release", cuda.cuMemRelease(C.c_uint64(h)))
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--size-mib", type=float, default=2)
    a = ap.parse_args()
    use_device(0)
    count = C.c_int()
    ck("count", cuda.cuDeviceGetCount(C.byref(count)))
    size = int(a.size_mib * MIB)
    print(f"{a.n} allocations of {a.size_mib} MiB, {count.value} device(s); "
          "median us per call (total ms per cycle)")
    cases = [("plain", False, [0]), ("posix-fd", True, [0])]
    if count.value > 1:
        cases.append(("posix-fd, 2 devices", True, [0, 1]))
    for name, fdh, devs in cases:
        r = run_case(a.n, size, fdh, devs)
        cols = "  ".join(f"{k} {m:7.1f} ({tot:6.1f})" for k, (m, tot) in r.items())
        print(f"{name:18} {cols}", flush=True)
    for threads in (1, 4):
        ms = export_threads(a.n, size, threads)
        print(f"export of {a.n} fresh handles from {threads} thread(s): {ms:.1f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
