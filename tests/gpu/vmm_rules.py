#!/usr/bin/env python3
"""The CUDA VMM rules that memsaver and its fake driver (tests/fake-cuda) rely on, checked on
device 0 of a real GPU.

Facts (as measured on an H100, driver 580.159):

1. one cuMemUnmap may cover several adjacent mappings inside one reservation;
2. one cuMemSetAccess may cover several adjacent mappings inside one reservation;
3. one allocation may be mapped whole over a range that held several mappings before;
4. mappings may sit anywhere inside a larger reservation;
5. part of an allocation does not map: cuMemMap with a size below the allocation's, or with a
   nonzero offset, is CUDA_ERROR_NOT_SUPPORTED (801);
6. part of a mapping does not unmap: CUDA_ERROR_INVALID_VALUE (1), as the fake driver answers;
7. cuMemAddressReserve with a hint at the end of an existing reservation, the space there
   being free, gives that address (memsaver's runs rely on it: docs/architecture.md, "Runs");
   measured again on an H100, driver 580.159.04, 2026-11-27;
8. one mapping may span two adjacent reservations, and a write across it works (runs of
   allocations and of NCCL's buffers rely on it);
9. cuMemGetAddressRange of an address gives the mapping holding it, across reservations, not
   its reservation (NCCL's free path asks it for the size to unmap and free: memsaver answers
   for buffers inside a run); nothing mapped there: CUDA_ERROR_NOT_FOUND (500);
10. cuMemAddressFree of a reservation that a mapping crosses is refused (memsaver frees a range
   NCCL freed inside a run only once the run is unmapped);
11. eight reservations of 64 GiB of addresses, aligned to 1 GiB, are given (an importer of NCCL
   buffers reserves one per block of an owner's addresses, to lay its imports out as the owner
   does), and an allocation maps anywhere inside one;
12. part of a mapping does not take cuMemSetAccess: CUDA_ERROR_INVALID_VALUE (1), before and
   after the whole mapping was granted access (measured on an H200, driver 580.159.04,
   2026-11-29): memory that backs several buffers with one allocation must be granted access
   whole, never buffer by buffer.

Usage: python3 tests/gpu/vmm_rules.py
Talks to libcuda.so.1 with ctypes (no torch; MEMSAVER_CUDA_LIB names another library, such as
the fake driver). One line per fact with the result codes; exits non-zero if any fact does
not hold, or a call that must succeed fails.
"""
import ctypes as C
import os
import sys

cuda = C.CDLL(os.environ.get("MEMSAVER_CUDA_LIB") or "libcuda.so.1")
NOT_SUPPORTED = 801


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


PROP = Prop(type=1, requestedHandleTypes=0, location=Location(1, 0))  # pinned, device 0
ACCESS = Access(Location(1, 0), 3)  # read-write for device 0


def name(r):
    s = C.c_char_p()
    cuda.cuGetErrorName(r, C.byref(s))
    return f"{s.value.decode() if s.value else '?'} ({r})"


def ck(what, r):
    if r != 0:
        raise SystemExit(f"{what} failed: {name(r)}")


def create(size):
    h = C.c_uint64()
    ck("cuMemCreate", cuda.cuMemCreate(C.byref(h), C.c_size_t(size), C.byref(PROP), C.c_uint64(0)))
    return h


def reserve(size, hint=0):
    p = C.c_uint64()
    ck("cuMemAddressReserve", cuda.cuMemAddressReserve(C.byref(p), C.c_size_t(size), C.c_size_t(0),
                                                       C.c_uint64(hint), C.c_uint64(0)))
    return p.value


def map_(va, size, h, offset=0):
    return cuda.cuMemMap(C.c_uint64(va), C.c_size_t(size), C.c_size_t(offset), h, C.c_uint64(0))


def unmap(va, size):
    return cuda.cuMemUnmap(C.c_uint64(va), C.c_size_t(size))


def access(va, size):
    return cuda.cuMemSetAccess(C.c_uint64(va), C.c_size_t(size), C.byref(ACCESS), C.c_size_t(1))


def touch(va, size):
    """Writes the range (cuMemsetD8) and waits: the mapping and its access really work."""
    r = cuda.cuMemsetD8_v2(C.c_uint64(va), C.c_ubyte(7), C.c_size_t(size))
    return r or cuda.cuCtxSynchronize()


def free(va, size):
    ck("cuMemAddressFree", cuda.cuMemAddressFree(C.c_uint64(va), C.c_size_t(size)))


def release(*hs):
    for h in hs:
        ck("cuMemRelease", cuda.cuMemRelease(h))


failed = []


def report(n, holds, text):
    print(f"fact {n}: {'holds' if holds else 'DOES NOT HOLD'}: {text}")
    if not holds:
        failed.append(n)


def facts_1_to_3(g):
    """Two 2-granule allocations side by side in one reservation, then one over both."""
    base = reserve(4 * g)
    a, b = create(2 * g), create(2 * g)
    ck("cuMemMap a", map_(base, 2 * g, a))
    ck("cuMemMap b", map_(base + 2 * g, 2 * g, b))
    r_access = access(base, 4 * g)
    if r_access == 0:
        ck("cuMemsetD8", touch(base, 4 * g))
    else:
        ck("cuMemSetAccess a", access(base, 2 * g))
        ck("cuMemSetAccess b", access(base + 2 * g, 2 * g))
    r = unmap(base, 4 * g)
    if r != 0:
        ck("cuMemUnmap a", unmap(base, 2 * g))
        ck("cuMemUnmap b", unmap(base + 2 * g, 2 * g))
    report(1, r == 0, f"one cuMemUnmap over two adjacent mappings: {name(r)}")
    report(2, r_access == 0, f"one cuMemSetAccess over two adjacent mappings: {name(r_access)}")
    c = create(4 * g)
    r = map_(base, 4 * g, c)
    if r == 0:
        ck("cuMemSetAccess", access(base, 4 * g))
        ck("cuMemsetD8", touch(base, 4 * g))
        ck("cuMemUnmap", unmap(base, 4 * g))
    report(3, r == 0, f"one allocation mapped whole where two mappings were: {name(r)}")
    release(a, b, c)
    free(base, 4 * g)


def fact_4(g):
    """Two allocations inside a reservation of 8 granules: in the middle and at the end."""
    base = reserve(8 * g)
    a, b = create(2 * g), create(g)
    r1 = map_(base + 3 * g, 2 * g, a)
    r2 = map_(base + 7 * g, g, b)
    for r, va, size in ((r1, base + 3 * g, 2 * g), (r2, base + 7 * g, g)):
        if r == 0:
            ck("cuMemSetAccess", access(va, size))
            ck("cuMemsetD8", touch(va, size))
            ck("cuMemUnmap", unmap(va, size))
    report(4, r1 == 0 and r2 == 0,
           f"mappings at granules 3-4 and 7 of an 8-granule reservation: {name(r1)}, {name(r2)}")
    release(a, b)
    free(base, 8 * g)


def fact_5(g):
    """A 2-granule allocation: its first granule alone, then its second (offset 1 granule)."""
    base = reserve(2 * g)
    h = create(2 * g)
    r1 = map_(base, g, h)
    if r1 == 0:
        ck("cuMemUnmap", unmap(base, g))
    r2 = map_(base, g, h, offset=g)
    if r2 == 0:
        ck("cuMemUnmap", unmap(base, g))
    report(5, r1 == NOT_SUPPORTED and r2 == NOT_SUPPORTED,
           f"cuMemMap of half an allocation at offset 0: {name(r1)}; at offset {g}: {name(r2)}"
           f" (expected {NOT_SUPPORTED})")
    release(h)
    free(base, 2 * g)


def fact_6(g):
    """A 2-granule mapping: unmap its first granule, then its second, then the whole."""
    base = reserve(2 * g)
    h = create(2 * g)
    ck("cuMemMap", map_(base, 2 * g, h))
    ck("cuMemSetAccess", access(base, 2 * g))
    r1, r2 = unmap(base, g), unmap(base + g, g)
    whole = unmap(base, 2 * g) if r1 != 0 and r2 != 0 else None
    report(6, r1 != 0 and r2 != 0 and whole == 0,
           f"cuMemUnmap of the first half of a mapping: {name(r1)}; of the second: {name(r2)}"
           f"; then of the whole: {name(whole) if whole is not None else 'not tried'}"
           " (the fake driver answers CUDA_ERROR_INVALID_VALUE (1))")
    release(h)
    if whole is not None:
        free(base, 2 * g)  # else half of it may still be mapped: leave it to the process's end


def fact_7_to_10(g):
    """A reservation, then one asked for right after it; if given there, one mapping over both."""
    a = reserve(2 * g)
    b = reserve(2 * g, hint=a + 2 * g)
    given = b == a + 2 * g
    report(7, given, f"cuMemAddressReserve with a hint at the end of a reservation ({a + 2 * g:#x})"
           f" gave {b:#x}: {'the hint' if given else 'another address'} (memsaver's runs rely on the hint)")
    if given:
        base, size = C.c_uint64(), C.c_size_t()
        r_empty = cuda.cuMemGetAddressRange_v2(C.byref(base), C.byref(size), C.c_uint64(a + g))
        h = create(4 * g)
        r = map_(a, 4 * g, h)
        written = -1
        if r == 0:
            ck("cuMemSetAccess", access(a, 4 * g))
            written = touch(a, 4 * g)
            ranges = []
            for va in (a + g, b + g):
                rr = cuda.cuMemGetAddressRange_v2(C.byref(base), C.byref(size), C.c_uint64(va))
                ranges.append((rr, base.value, size.value))
            held = all(rr == 0 and bs == a and sz == 4 * g for rr, bs, sz in ranges)
            report(9, held and r_empty == 500,
                   f"cuMemGetAddressRange inside a mapping over two reservations: "
                   f"{[(name(rr), hex(bs), sz) for rr, bs, sz in ranges]} "
                   f"(expected ({a:#x}, {4 * g})); with nothing mapped: {name(r_empty)}")
            r_free = cuda.cuMemAddressFree(C.c_uint64(b), C.c_size_t(2 * g))
            report(10, r_free != 0, f"cuMemAddressFree of a reservation a mapping crosses: {name(r_free)}")
            ck("cuMemUnmap", unmap(a, 4 * g))
            if r_free == 0:
                b = None
        report(8, r == 0 and written == 0,
               f"one mapping over two adjacent reservations: {name(r)}; a write across it: "
               f"{name(written) if written >= 0 else 'not tried'}")
        release(h)
    else:
        print("facts 8-10: not tried (the reservations are not adjacent)")
        failed.extend([8, 9, 10])
    free(a, 2 * g)
    if b is not None:
        free(b, 2 * g)


def fact_11(g):
    """Eight 64 GiB reservations aligned to 1 GiB; a mapping at an offset inside the last."""
    block, got = 64 << 30, []
    for _ in range(8):
        p = C.c_uint64()
        r = cuda.cuMemAddressReserve(C.byref(p), C.c_size_t(block), C.c_size_t(1 << 30),
                                     C.c_uint64(0), C.c_uint64(0))
        if r != 0:
            break
        got.append(p.value)
    aligned = all(p % (1 << 30) == 0 for p in got)
    mapped = -1
    if got:
        h = create(g)
        va = got[-1] + (37 << 30) + 5 * g
        mapped = map_(va, g, h)
        if mapped == 0:
            ck("cuMemSetAccess", access(va, g))
            ck("cuMemsetD8", touch(va, g))
            ck("cuMemUnmap", unmap(va, g))
        release(h)
    report(11, len(got) == 8 and aligned and mapped == 0,
           f"{len(got)} of 8 reservations of 64 GiB aligned to 1 GiB given (aligned: {aligned});"
           f" a mapping inside one: {name(mapped) if mapped >= 0 else 'not tried'}")
    for p in got:
        free(p, block)


def fact_12(g):
    """An 8-granule mapping: access to granule 1 alone, then to the whole, then to granule 2."""
    base = reserve(8 * g)
    h = create(8 * g)
    ck("cuMemMap", map_(base, 8 * g, h))
    before = access(base + g, g)
    ck("cuMemSetAccess of the whole", access(base, 8 * g))
    after = access(base + 2 * g, g)
    ck("cuMemsetD8", touch(base, 8 * g))
    report(12, before != 0 and after != 0,
           f"cuMemSetAccess of one granule of a mapping: {name(before)} before the whole was "
           f"granted, {name(after)} after (the fake driver answers CUDA_ERROR_INVALID_VALUE (1))")
    ck("cuMemUnmap", unmap(base, 8 * g))
    release(h)
    free(base, 8 * g)


def main():
    ck("cuInit", cuda.cuInit(0))
    dev, ctx = C.c_int(), C.c_void_p()
    ck("cuDeviceGet", cuda.cuDeviceGet(C.byref(dev), 0))
    ck("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(C.byref(ctx), dev))
    ck("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx))
    version, g = C.c_int(), C.c_size_t()
    ck("cuDriverGetVersion", cuda.cuDriverGetVersion(C.byref(version)))
    ck("cuMemGetAllocationGranularity",
       cuda.cuMemGetAllocationGranularity(C.byref(g), C.byref(PROP), 0))
    print(f"device 0, CUDA driver API {version.value}, granularity {g.value >> 20} MiB")
    for check in (facts_1_to_3, fact_4, fact_5, fact_6, fact_7_to_10, fact_11, fact_12):
        check(g.value)
    if failed:
        print(f"FAIL: facts {', '.join(map(str, sorted(failed)))} do not hold here")
        return 1
    print("PASS: every fact holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
