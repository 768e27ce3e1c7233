#!/usr/bin/env python3
"""Which ways of getting pinned host memory stall the application's CUDA calls on other threads.

A background thread obtains TOTAL bytes of pinned host memory in chunks of CHUNK bytes, by one
method at a time, while the main thread keeps making the calls an application makes: a device
allocation the way memsaver makes one (cuMemCreate + cuMemMap + cuMemSetAccess of 2 MiB, then
unmap + release) and a kernel (a small matmul, launched and synchronised). For each method and
chunk size it prints how long the background work took (GiB/s) and the longest and 99th
percentile main-thread call while it ran, next to the same calls with nothing in the background.
Then it frees the memory the same way (cuMemFreeHost / cuMemHostUnregister + munmap) and prints
the stalls of that phase too. Last, the D2H and H2D copy bandwidth of one 1 GiB buffer copied
through pinned chunks of each size (does a backup made of chunks copy as fast as one buffer?),
and of one contiguous buffer registered in chunks and copied with one call spanning them all.

Methods:
  host_alloc     cuMemHostAlloc(PORTABLE)           what memsaver's prepared backups use
  alloc_host     cuMemAllocHost
  cuda_host      cudaHostAlloc (torch's libcudart)
  register       mmap + fault every page in (memset) + cuMemHostRegister(PORTABLE)
  register_cold  mmap + cuMemHostRegister without faulting the pages in first
  register_pop   mmap(MAP_POPULATE) + cuMemHostRegister: the kernel faults the pages in
  register_thp   mmap + madvise(HUGEPAGE, POPULATE_WRITE) + cuMemHostRegister
  fixed          one PROT_NONE reservation of TOTAL bytes, then per chunk
                 mmap(MAP_FIXED | MAP_POPULATE) + cuMemHostRegister: contiguous, pinned in steps
  span           one mmap of TOTAL bytes, then per chunk madvise(POPULATE_WRITE) +
                 cuMemHostRegister: one contiguous buffer pinned in bounded steps
  prefault       mmap + memset only (no pinning): the CPU work alone
  populate_thp   mmap + madvise(HUGEPAGE, POPULATE_WRITE) only (no pinning)

Usage: python3 bench/host_alloc_blocking.py [--total-mib 2048] [--chunks 2,16,64,256,1024]
Needs a GPU and torch (for the kernel and for libcudart). Exits non-zero if a call fails.
"""
import argparse
import ctypes as C
import mmap
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from vmm_ops import MIB, Access, Location, Prop, ck, cuda  # noqa: E402

PORTABLE = 1
MADV_POPULATE_WRITE = 23  # Linux 5.14
libc = C.CDLL(None)
libc.memset.restype = C.c_void_p
libc.memset.argtypes = [C.c_void_p, C.c_int, C.c_size_t]
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
libc.munmap.argtypes = [C.c_void_p, C.c_size_t]


def cudart():
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "libcudart.so" in path:
            return C.CDLL(path)
    raise SystemExit("torch's libcudart is not loaded")


RT = None


class Method:
    """Obtains and releases one chunk of pinned host memory."""

    def __init__(self, name):
        self.name = name

    def get(self, n):
        p = C.c_void_p()
        if self.name == "host_alloc":
            ck("cuMemHostAlloc", cuda.cuMemHostAlloc(C.byref(p), C.c_size_t(n), PORTABLE))
            return (p.value, None)
        if self.name == "alloc_host":
            ck("cuMemAllocHost", cuda.cuMemAllocHost_v2(C.byref(p), C.c_size_t(n)))
            return (p.value, None)
        if self.name == "cuda_host":
            r = RT.cudaHostAlloc(C.byref(p), C.c_size_t(n), PORTABLE)
            if r != 0:
                raise SystemExit(f"cudaHostAlloc failed: {r}")
            return (p.value, None)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if self.name == "register_pop":
            flags |= mmap.MAP_POPULATE
        m = mmap.mmap(-1, n, flags=flags)
        addr = C.addressof(C.c_char.from_buffer(m))
        if self.name in ("register", "prefault"):
            libc.memset(addr, 0, n)  # a foreign call: the GIL is released meanwhile
        if self.name in ("register_thp", "populate_thp"):
            m.madvise(mmap.MADV_HUGEPAGE)
            m.madvise(MADV_POPULATE_WRITE)
        if self.name.startswith("register"):
            ck("cuMemHostRegister",
               cuda.cuMemHostRegister_v2(C.c_void_p(addr), C.c_size_t(n), PORTABLE))
        return (addr, m)

    def put(self, chunk):
        addr, m = chunk
        if self.name in ("host_alloc", "alloc_host"):
            ck("cuMemFreeHost", cuda.cuMemFreeHost(C.c_void_p(addr)))
        elif self.name == "cuda_host":
            RT.cudaFreeHost(C.c_void_p(addr))
        else:
            if self.name.startswith("register"):
                ck("cuMemHostUnregister", cuda.cuMemHostUnregister(C.c_void_p(addr)))
            m.close()


class Probe:
    """The application's calls on the main thread: a VMM allocation (2 MiB unless told) and a
    kernel."""

    def __init__(self, size):
        self.size = size
        self.prop = Prop(type=1, requestedHandleTypes=0, location=Location(1, 0))
        self.access = Access(Location(1, 0), 3)
        va = C.c_uint64()
        ck("reserve", cuda.cuMemAddressReserve(C.byref(va), C.c_size_t(size), C.c_size_t(0),
                                               C.c_uint64(0), C.c_uint64(0)))
        self.va = va.value
        self.a = torch.randn(256, 256, device="cuda")

    def alloc(self):
        h = C.c_uint64()
        t = time.perf_counter()
        ck("create", cuda.cuMemCreate(C.byref(h), C.c_size_t(self.size), C.byref(self.prop),
                                      C.c_uint64(0)))
        ck("map", cuda.cuMemMap(C.c_uint64(self.va), C.c_size_t(self.size), C.c_size_t(0), h,
                                C.c_uint64(0)))
        ck("access", cuda.cuMemSetAccess(C.c_uint64(self.va), C.c_size_t(self.size),
                                         C.byref(self.access), C.c_size_t(1)))
        dt = time.perf_counter() - t
        ck("unmap", cuda.cuMemUnmap(C.c_uint64(self.va), C.c_size_t(self.size)))
        ck("release", cuda.cuMemRelease(h))
        return dt

    def kernel(self):
        t = time.perf_counter()
        (self.a @ self.a).sum()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def while_running(self, done):
        """Probes until `done` is set; returns (alloc samples, kernel samples) in ms."""
        al, ke = [], []
        while not done.is_set():
            al.append(self.alloc() * 1e3)
            ke.append(self.kernel() * 1e3)
        return al, ke


def span_get(total, chunk):
    """One contiguous mapping, populated and registered chunk by chunk."""
    m = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = C.addressof(C.c_char.from_buffer(m))
    for off in range(0, total, chunk):
        m.madvise(MADV_POPULATE_WRITE, off, chunk)
        ck("cuMemHostRegister", cuda.cuMemHostRegister_v2(C.c_void_p(addr + off),
                                                          C.c_size_t(chunk), PORTABLE))
    return addr, m


def fixed_get(total, chunk):
    """A reservation, filled chunk by chunk with populated mappings, each registered."""
    base = libc.mmap(None, total, 0,  # PROT_NONE
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)  # MAP_NORESERVE
    if base in (None, C.c_void_p(-1).value):
        raise SystemExit("reserve failed")
    for off in range(0, total, chunk):
        p = libc.mmap(base + off, chunk, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10 | mmap.MAP_POPULATE, -1, 0)
        if p != base + off:
            raise SystemExit("mmap(MAP_FIXED) failed")
        ck("cuMemHostRegister", cuda.cuMemHostRegister_v2(C.c_void_p(base + off),
                                                          C.c_size_t(chunk), PORTABLE))
    return base


def fixed_put(total, chunk, base):
    for off in range(0, total, chunk):
        ck("cuMemHostUnregister", cuda.cuMemHostUnregister(C.c_void_p(base + off)))
    libc.munmap(base, total)


def span_put(total, chunk, got):
    addr, m = got
    for off in range(0, total, chunk):
        ck("cuMemHostUnregister", cuda.cuMemHostUnregister(C.c_void_p(addr + off)))
    m.close()


def span_copies(chunks_mib):
    """GB/s of one 1 GiB copy each way into one buffer registered in chunks (one call)."""
    n = 1 << 30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    print("\none 1 GiB copy into one buffer registered in chunks (GB/s, best of 3)")
    print(f"{'chunk MiB':>9} {'D2H':>7} {'H2D':>7}")
    for c in chunks_mib:
        addr, m = span_get(n, c * MIB)
        d2h, h2d = bandwidth([(addr, dev.data_ptr(), n)])
        span_put(n, c * MIB, (addr, m))
        print(f"{c:>9} {d2h:>7.1f} {h2d:>7.1f}", flush=True)


def bandwidth(copies):
    """Best-of-3 GB/s of the copies (host, device, bytes) D2H, then H2D, on one stream."""
    s = C.c_void_p(torch.cuda.current_stream().cuda_stream)
    n = sum(c[2] for c in copies)
    out = []
    for d2h in (True, False):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for host, dev, size in copies:
                h, d, b = C.c_void_p(host), C.c_uint64(dev), C.c_size_t(size)
                if d2h:
                    ck("d2h", cuda.cuMemcpyDtoHAsync_v2(h, d, b, s))
                else:
                    ck("h2d", cuda.cuMemcpyHtoDAsync_v2(d, h, b, s))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out.append(n / min(times) / 1e9)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def phase(probe, work):
    """Runs `work` on a thread while the main thread probes; (seconds, alloc ms, kernel ms)."""
    done = threading.Event()
    out = {}

    def body():
        t = time.perf_counter()
        try:
            out["result"] = work()
        finally:
            out["s"] = time.perf_counter() - t
            done.set()

    ctx = C.c_void_p()
    ck("ctx", cuda.cuCtxGetCurrent(C.byref(ctx)))

    def run():
        ck("ctx", cuda.cuCtxSetCurrent(ctx))
        body()

    th = threading.Thread(target=run)
    th.start()
    al, ke = probe.while_running(done)
    th.join()
    if "result" not in out:
        raise SystemExit("the background work failed")
    return out["s"], al, ke, out["result"]


def row(label, chunk_mib, total, s, al, ke):
    gbs = total / s / 1e9 if s > 0 else float("inf")
    print(f"{label:<24} {chunk_mib:>6} {s * 1e3:>9.0f} {gbs:>7.2f} {len(al):>6} "
          f"{max(al):>9.2f} {pct(al, .99):>8.2f} {max(ke):>9.2f} {pct(ke, .99):>8.2f}",
          flush=True)


def copies(chunks_mib, method):
    """D2H and H2D GB/s of 1 GiB through pinned chunks of each size, obtained by `method`."""
    n = 1 << 30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    print(f"\ncopy of 1 GiB through pinned chunks from {method} (GB/s, best of 3)")
    print(f"{'chunk MiB':>9} {'D2H':>7} {'H2D':>7}")
    for c in chunks_mib:
        size = c * MIB
        bufs = [Method(method).get(size) for _ in range(n // size)]
        d2h, h2d = bandwidth([(p, dev.data_ptr() + i * size, size)
                              for i, (p, _) in enumerate(bufs)])
        for b in bufs:
            Method(method).put(b)
        print(f"{c:>9} {d2h:>7.1f} {h2d:>7.1f}", flush=True)


def main():
    global RT
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mib", type=int, default=2048)
    ap.add_argument("--chunks", default="2,16,64,256,1024")
    ap.add_argument("--methods",
                    default="host_alloc,alloc_host,cuda_host,register,register_cold,"
                    "register_pop,register_thp,fixed,span,prefault,populate_thp")
    ap.add_argument("--probe-mib", type=int, default=2,
                    help="size of the main thread's device allocations")
    ap.add_argument("--no-copies", action="store_true", help="no copies through chunks")
    ap.add_argument("--no-span-copy", action="store_true", help="no copy spanning chunks")
    args = ap.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    RT = cudart()
    total = args.total_mib * MIB
    chunks = [int(c) for c in args.chunks.split(",")]
    probe = Probe(args.probe_mib * MIB)
    for _ in range(50):  # warm up both probes
        probe.alloc()
        probe.kernel()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.total_mib} MiB per case; main-thread calls in ms")
    print(f"{'case':<24} {'chunk':>6} {'bg ms':>9} {'GiB/s':>7} {'probes':>6} "
          f"{'alloc max':>9} {'p99':>8} {'kern max':>9} {'p99':>8}")
    base = phase(probe, lambda: time.sleep(1.0))
    row("idle (baseline)", 0, total, 1.0, base[1], base[2])
    for name in args.methods.split(","):
        if name in ("span", "fixed"):
            get, put = (span_get, span_put) if name == "span" else (fixed_get, fixed_put)
            for c in chunks:
                s, al, ke, got = phase(probe, lambda c=c, get=get: get(total, c * MIB))
                row(f"{name} get", c, total, s, al, ke)
                s, al, ke, _ = phase(probe, lambda c=c, got=got, put=put: put(total, c * MIB, got))
                row(f"{name} free", c, total, s, al, ke)
            continue
        m = Method(name)
        for c in chunks:
            size = c * MIB
            if size > total:
                continue
            s, al, ke, got = phase(probe, lambda m=m, size=size: [
                m.get(size) for _ in range(total // size)])
            row(f"{name} get", c, total, s, al, ke)
            s, al, ke, _ = phase(probe, lambda m=m, got=got: [m.put(x) for x in got])
            row(f"{name} free", c, total, s, al, ke)
    if not args.no_copies:
        for method in ("host_alloc", "register"):
            copies([c for c in chunks if c * MIB <= 1 << 30], method)
    if not args.no_span_copy:
        span_copies([c for c in chunks if c * MIB <= 1 << 30])
    print(f"\nbaseline medians: alloc {statistics.median(base[1]):.3f} ms, "
          f"kernel {statistics.median(base[2]):.3f} ms")


if __name__ == "__main__":
    main()
