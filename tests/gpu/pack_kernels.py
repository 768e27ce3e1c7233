"""Checks memsaver's packing kernels (allocator/kernels/pack.ptx) on a GPU, through the driver
API as memsaver calls them: the packed blocks and their index are exactly the non-zero 4 KiB
blocks, the round trip (zero fill, unpack) is bit-exact, for a partial last block, all zeros,
nothing zero (the buffer too small: the count says so), a block that turns zero and back, and
memory NCCL-shaped (a few KiB live at the start of each 2 MiB granule). Prints the time of a
pack and an unpack of 3 GiB so shaped. Exits non-zero on any failure.

    python3 tests/gpu/pack_kernels.py [--ptx allocator/kernels/pack.ptx]
"""

import argparse
import ctypes
import sys
import time

import torch

BLOCK = 4096
THREADS = 256


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

    def _launch(self, f, grid: int, args: list) -> None:
        arr = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.cu.cuLaunchKernel(f, grid, 1, 1, THREADS, 1, 1, 0, stream, arr, None), "cuLaunchKernel")

    def pack(self, src: torch.Tensor, host: torch.Tensor) -> tuple[int, int]:
        """Packs src (uint8, device) into host (pinned uint8); returns (count, capacity)."""
        length, cap_bytes = src.numel(), host.numel()
        capacity = (cap_bytes - 8) // (BLOCK + 4)
        base = host.data_ptr()
        index_at = base + cap_bytes - 8 - 4 * capacity
        count_at = base + cap_bytes - 8
        blocks = (length + BLOCK - 1) // BLOCK
        grid = max(1, min(blocks, self.sms * 8))
        args = [ctypes.c_uint64(src.data_ptr()), ctypes.c_uint64(length), ctypes.c_uint64(base),
                ctypes.c_uint64(index_at), ctypes.c_uint64(count_at), ctypes.c_uint32(capacity)]
        self._launch(self.pack_f, grid, args)
        torch.cuda.synchronize()
        return ctypes.c_uint32.from_address(count_at).value, capacity

    def unpack(self, dst: torch.Tensor, host: torch.Tensor, count: int) -> None:
        cap_bytes = host.numel()
        capacity = (cap_bytes - 8) // (BLOCK + 4)
        base = host.data_ptr()
        index_at = base + cap_bytes - 8 - 4 * capacity
        dst.zero_()
        grid = max(1, min(count, self.sms * 8))
        args = [ctypes.c_uint64(dst.data_ptr()), ctypes.c_uint64(dst.numel()), ctypes.c_uint64(base),
                ctypes.c_uint64(index_at), ctypes.c_uint32(count)]
        if count:
            self._launch(self.unpack_f, grid, args)
        torch.cuda.synchronize()


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
    index_at = host.numel() - 8 - 4 * capacity
    index = host[index_at:index_at + 4 * count].view(torch.int32).tolist()
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
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        count, _ = k.pack(big, host)
        t1 = time.perf_counter()
        out = torch.empty_like(big)
        t2 = time.perf_counter()
        k.unpack(out, host, count)
        t3 = time.perf_counter()
        times.append((t1 - t0, t3 - t2))
    check(torch.equal(out, big), "NCCL-shaped: contents differ after the round trip")
    check(count == view.shape[0], f"NCCL-shaped: {count} blocks packed, want {view.shape[0]}")
    full = torch.empty(3 << 30, dtype=torch.uint8, pin_memory=True)
    t0 = time.perf_counter()
    full.copy_(big, non_blocking=True)
    torch.cuda.synchronize()
    t_full = time.perf_counter() - t0
    pk = sorted(t[0] for t in times)[len(times) // 2] * 1e3
    up = sorted(t[1] for t in times)[len(times) // 2] * 1e3
    print(f"PACK_BENCH {{\"bytes\": {3 << 30}, \"packed_bytes\": {count * BLOCK}, \"pack_ms\": {pk:.2f}, "
          f"\"unpack_with_zero_fill_ms\": {up:.2f}, \"whole_copy_ms\": {t_full * 1e3:.2f}}}")
    print("PASS pack_kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
