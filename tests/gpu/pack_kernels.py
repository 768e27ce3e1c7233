"""Checks memsaver's packing kernels (allocator/kernels/pack.ptx) on a GPU, through the driver
API as memsaver calls them (one batch parameter, allocator/src/packed.rs): the packed blocks and
their index are exactly the non-zero 4 KiB blocks, the round trip (zero fill, unpack) is
bit-exact, for a partial last block, all zeros, nothing zero (the buffer too small: the count
says so), a block that turns zero and back, a batch of 64 pieces, and memory NCCL-shaped (a few
KiB live at the start of each 2 MiB granule). Prints the time of a pack and an unpack of 3 GiB so
shaped, in 2 MiB pieces as NCCL's buffers are. Exits non-zero on any failure.

    python3 tests/gpu/pack_kernels.py [--ptx allocator/kernels/pack.ptx]
"""

import argparse
import ctypes
import sys
import time

import torch

BLOCK = 4096
THREADS = 256
MAX_PIECES = 64


class PackPiece(ctypes.Structure):
    _fields_ = [
        ("src", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("dst", ctypes.c_uint64),
        ("index", ctypes.c_uint64),
        ("count", ctypes.c_uint64),
        ("slots", ctypes.c_uint32),
        ("first", ctypes.c_uint32),
    ]


class PackBatch(ctypes.Structure):
    _fields_ = [("piece", PackPiece * MAX_PIECES), ("pieces", ctypes.c_uint32), ("blocks", ctypes.c_uint32)]


class UnpackPiece(ctypes.Structure):
    _fields_ = [
        ("dst", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("src", ctypes.c_uint64),
        ("index", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("first", ctypes.c_uint32),
    ]


class UnpackBatch(ctypes.Structure):
    _fields_ = [("piece", UnpackPiece * MAX_PIECES), ("pieces", ctypes.c_uint32), ("slots", ctypes.c_uint32)]


assert ctypes.sizeof(PackBatch) == 64 * 48 + 8 and ctypes.sizeof(UnpackBatch) == 64 * 40 + 8


def layout(cap: int) -> tuple[int, int, int]:
    """(slots, index offset, count offset) of a packed backup of ``cap`` bytes."""
    count_at = (cap - 8) & ~7
    slots = count_at // (BLOCK + 4)
    return slots, count_at - 4 * slots, count_at


def check(ok: bool, what: str) -> None:
    if not ok:
        print(f"FAIL: {what}", flush=True)
        sys.exit(1)


class Kernels:
    def __init__(self, ptx: bytes) -> None:
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # makes the primary context current
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.mod = ctypes.c_void_p()
        self._ok(self.cu.cuModuleLoadData(ctypes.byref(self.mod), ctypes.c_char_p(ptx + b"\0")), "cuModuleLoadData")
        self.pack_f, self.unpack_f = ctypes.c_void_p(), ctypes.c_void_p()
        self._ok(self.cu.cuModuleGetFunction(ctypes.byref(self.pack_f), self.mod, b"memsaver_pack"), "pack")
        self._ok(self.cu.cuModuleGetFunction(ctypes.byref(self.unpack_f), self.mod, b"memsaver_unpack"), "unpack")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count

    def _ok(self, r: int, what: str) -> None:
        check(r == 0, f"{what} returned CUDA error {r}")

    def _launch(self, f, grid: int, args: list) -> None:  # args: one ctypes value per parameter
        arr = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.cu.cuLaunchKernel(f, grid, 1, 1, THREADS, 1, 1, 0, stream, arr, None), "cuLaunchKernel")

    def pack_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
        """Packs each (device uint8 tensor, pinned uint8 tensor) pair in launches of up to 64;
        returns the counts."""
        counts = []
        for at in range(0, len(pairs), MAX_PIECES):
            b = PackBatch()
            blocks = 0
            for i, (src, host) in enumerate(pairs[at : at + MAX_PIECES]):
                slots, index_at, count_at = layout(host.numel())
                base = host.data_ptr()
                b.piece[i] = PackPiece(
                    src.data_ptr(), src.numel(), base, base + index_at, base + count_at, slots, blocks
                )
                blocks += (src.numel() + BLOCK - 1) // BLOCK
            b.pieces, b.blocks = len(pairs[at : at + MAX_PIECES]), blocks
            self._launch(self.pack_f, max(1, min(blocks, self.sms * 8)), [b])
        torch.cuda.synchronize()
        for _, host in pairs:
            counts.append(ctypes.c_uint32.from_address(host.data_ptr() + layout(host.numel())[2]).value)
        return counts

    def pack(self, src: torch.Tensor, host: torch.Tensor) -> tuple[int, int]:
        """Packs src (uint8, device) into host (pinned uint8); returns (count, slots)."""
        return self.pack_many([(src, host)])[0], layout(host.numel())[0]

    def unpack_many(self, triples: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Zero-fills each device tensor and puts back the blocks packed in its host tensor."""
        for dst, _, _ in triples:
            dst.zero_()
        for at in range(0, len(triples), MAX_PIECES):
            b = UnpackBatch()
            slots_all = 0
            for i, (dst, host, count) in enumerate(triples[at : at + MAX_PIECES]):
                _, index_at, _ = layout(host.numel())
                base = host.data_ptr()
                b.piece[i] = UnpackPiece(dst.data_ptr(), dst.numel(), base, base + index_at, count, slots_all)
                slots_all += count
            b.pieces, b.slots = len(triples[at : at + MAX_PIECES]), slots_all
            if slots_all:
                self._launch(self.unpack_f, max(1, min(slots_all, self.sms * 8)), [b])
        torch.cuda.synchronize()

    def unpack(self, dst: torch.Tensor, host: torch.Tensor, count: int) -> None:
        self.unpack_many([(dst, host, count)])


def nonzero_blocks(t: torch.Tensor) -> set[int]:
    n = t.numel()
    pad = (-n) % BLOCK
    full = torch.cat([t, torch.zeros(pad, dtype=torch.uint8, device=t.device)]) if pad else t
    nz = full.view(-1, BLOCK).ne(0).any(dim=1).nonzero().flatten().tolist()
    return set(nz)


def round_trip(k: Kernels, src: torch.Tensor, name: str, cap_bytes: int | None = None) -> int:
    host = torch.empty(cap_bytes or src.numel(), dtype=torch.uint8, pin_memory=True)
    host.fill_(0x5A)
    count, capacity = k.pack(src, host)
    want = nonzero_blocks(src)
    check(count == len(want), f"{name}: {count} blocks packed, {len(want)} are non-zero")
    if count > capacity:
        print(f"ok {name}: {count} non-zero blocks > capacity {capacity}: reported as too small")
        return count
    _, index_at, _ = layout(host.numel())
    index = host[index_at : index_at + 4 * count].view(torch.int32).tolist()
    check(set(index) == want, f"{name}: the index names other blocks than the non-zero ones")
    out = torch.full_like(src, 0xA5)  # fresh memory holds junk
    k.unpack(out, host, count)
    check(torch.equal(out, src), f"{name}: contents differ after the round trip")
    print(f"ok {name}: {src.numel()} bytes, {count} blocks packed, exact")
    return count


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ptx", default="allocator/kernels/pack.ptx")
    a = ap.parse_args()
    k = Kernels(open(a.ptx, "rb").read())
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"

    # Sparse random blocks, a partial last block that holds something.
    n = 64 * BLOCK + 1000
    src = torch.zeros(n, dtype=torch.uint8, device=dev)
    for b in (0, 3, 17, 63):
        src[b * BLOCK + 5] = 7
    src[64 * BLOCK + 999] = 1
    round_trip(k, src, "sparse with partial tail")
    round_trip(k, torch.zeros(n, dtype=torch.uint8, device=dev), "all zeros")
    dense = torch.randint(1, 255, (32 * BLOCK,), dtype=torch.uint8, device=dev, generator=g)
    round_trip(k, dense, "dense, buffer too small")
    round_trip(k, dense, "dense, buffer large enough", cap_bytes=40 * BLOCK)
    # A block that turns zero, and one that turns non-zero, between two pauses.
    src2 = src.clone()
    src2[3 * BLOCK + 5] = 0
    src2[40 * BLOCK + 4095] = 9
    round_trip(k, src2, "changed between pauses")

    # NCCL-shaped: 3 GiB of 2 MiB granules, 3 KiB live at the start of each.
    gran = 2 << 20
    big = torch.zeros(3 << 30, dtype=torch.uint8, device=dev)
    view = big.view(-1, gran)
    view[:, :3072] = torch.randint(1, 255, (view.shape[0], 3072), dtype=torch.uint8, device=dev, generator=g)
    host = torch.empty(3 << 30, dtype=torch.uint8, pin_memory=True)
    pieces = list(big.split(gran))
    hosts = list(host.split(gran))
    out = torch.empty_like(big)
    outs = list(out.split(gran))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        counts = k.pack_many(list(zip(pieces, hosts, strict=True)))
        t1 = time.perf_counter()
        k.unpack_many(list(zip(outs, hosts, counts, strict=True)))
        t2 = time.perf_counter()
        times.append((t1 - t0, t2 - t1))
    count = sum(counts)
    check(torch.equal(out, big), "NCCL-shaped: contents differ after the round trip")
    check(count == view.shape[0], f"NCCL-shaped: {count} blocks packed, want {view.shape[0]}")
    # A batch of 64 pieces with different shapes, in one launch each way.
    srcs = [torch.zeros(BLOCK * (i + 17) + 13 * i, dtype=torch.uint8, device=dev) for i in range(64)]
    for i, t in enumerate(srcs):
        t[(i * 977) % t.numel()] = i + 1
        t[-1] = 255 - i
    hs = [torch.empty(t.numel() + 16 * BLOCK, dtype=torch.uint8, pin_memory=True) for t in srcs]
    cs = k.pack_many(list(zip(srcs, hs, strict=True)))
    check(cs == [len(nonzero_blocks(t)) for t in srcs], f"batch of 64: counts {cs}")
    outs64 = [torch.full_like(t, 0xA5) for t in srcs]
    k.unpack_many(list(zip(outs64, hs, cs, strict=True)))
    check(all(torch.equal(a, b) for a, b in zip(outs64, srcs, strict=True)), "batch of 64: contents differ")
    print("ok batch of 64 pieces: exact")
    full = torch.empty(3 << 30, dtype=torch.uint8, pin_memory=True)
    t0 = time.perf_counter()
    full.copy_(big, non_blocking=True)
    torch.cuda.synchronize()
    t_full = time.perf_counter() - t0
    pk = sorted(t[0] for t in times)[len(times) // 2] * 1e3
    up = sorted(t[1] for t in times)[len(times) // 2] * 1e3
    print(
        f'PACK_BENCH {{"bytes": {3 << 30}, "packed_bytes": {count * BLOCK}, "pack_ms": {pk:.2f}, '
        f'"unpack_with_zero_fill_ms": {up:.2f}, "whole_copy_ms": {t_full * 1e3:.2f}}}'
    )
    print("PASS pack_kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
