"""``memsaver bench nccl``: how long pausing and resuming NCCL's memory (the ``nccl`` tag) takes
in a job of N rank processes with C communicators.

The parent starts the ranks (``python -m memsaver._bench_nccl CONFIG``) under the preload,
waits for them within ``--timeout`` and prints their ``NCCL_BENCH`` lines; a rank that fails,
finds a wrong collective after a resume or does not finish makes the exit status non-zero,
with the rank and the problem on stderr (and the ranks' own stderr forwarded).

Each rank sets up C communicators over all ranks, warms each (all-reduce and all-to-all), then
runs K cycles: every rank pauses ``nccl`` at once, then resumes it at once (synchronised by a
file barrier in the run's directory, never by the paused NCCL), timed around the call, and the
collectives are checked after every resume.

- GPU (default): torch.distributed, one GPU per rank; the default group is gloo (the barrier),
  the C communicators are ``dist.new_group(..., backend="nccl")``.
- ``--native``: the same GPU workload without memsaver (no preload), switched by NCCL's own
  ``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`` / ``ncclCommResume`` on each communicator (NCCL
  2.29.7 or later, the one torch loads: for example ``LD_PRELOAD=<path>/libnccl.so.2``); the
  bytes NCCL says it can suspend (``ncclCommMemStats``) stand for what memsaver owns, and driver
  calls are not counted (``null``).
- ``--fake``: the fake CUDA driver and the fake NCCL of a checkout (``tests/fake-nccl``), no
  torch: each communicator is laid out as NCCL lays it out (``--buffers`` private buffers of 2
  MiB, then per peer a buffer of ``--mib`` exported to that peer, sent over a Unix socket and
  imported there, and a private buffer of 2 MiB); the "collectives" are every peer's pattern
  read through the imports, and the private buffers' own contents. Those hold what NCCL's do: a
  few KiB of structures in each 2 MiB granule, zeros elsewhere.
- ``--fake-nccl``: the same fake NCCL on this machine's CUDA driver, every rank on GPU 0: the
  driver's real costs for NCCL's pattern of buffers (``--buffers 320`` makes the 322 buffers per
  communicator real NCCL makes at 2 ranks) where one GPU is all there is.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

MIB = 1 << 20
#: The first NCCL with ncclCommSuspend/ncclCommResume.
NATIVE_MIN = (2, 29, 7)
#: The kinds of memsaver.stats().driver_calls that are cuMem* (VMM) calls.
VMM_KINDS = ("create", "map", "set_access", "unmap", "release", "export", "import", "reserve", "address_free")
#: The prefix of each rank's line on stdout.
LINE = "NCCL_BENCH "
#: The most fds one message carries (the kernel's SCM_MAX_FD).
MAX_FDS = 253


class BenchError(Exception):
    """A problem of the run, said so that a user can act on it."""


class UsageError(BenchError):
    """Flags that cannot run (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Options:
    ranks: int = 2
    comms: int = 1
    cycles: int = 5
    mib: int = 4
    timeout: float = 300.0
    buffers: int = 2
    fake: bool = False
    fake_nccl: bool = False
    native: bool = False


def options(flags: dict[str, Any]) -> Options:
    """Options from the parsed flags (``--ranks`` -> ``flags["ranks"]``; values as strings,
    None when not given), checked."""
    o = Options()
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Options):
        v = flags.get(f.name)
        if v is None or v is False:
            continue
        if f.type == "bool":
            values[f.name] = bool(v)
            continue
        conv = float if f.type == "float" else int
        try:
            values[f.name] = conv(v)
        except ValueError:
            raise UsageError(f"bad value for --{f.name}: {v}") from None
    o = dataclasses.replace(o, **values)
    if o.ranks < 2:
        raise UsageError(f"--ranks {o.ranks}: NCCL's communicators need 2 or more ranks (peers to share buffers with)")
    for name in ("comms", "cycles", "mib", "buffers"):
        if getattr(o, name) < 1:
            raise UsageError(f"--{name} {getattr(o, name)}: give 1 or more")
    if o.fake and o.fake_nccl:
        raise UsageError("--fake and --fake-nccl: give one (the fake NCCL on the fake driver, or on this machine's)")
    if (o.fake or o.fake_nccl) and o.comms > MAX_FDS:
        raise UsageError(
            f"--comms {o.comms}: the fake NCCL sends each peer its buffers in one message, at most {MAX_FDS}"
        )
    if o.timeout <= 0:
        raise UsageError(f"--timeout {o.timeout}: give a positive number of seconds")
    return o


def main(flags: dict[str, Any]) -> int:
    """Runs the benchmark; the exit status (0 done, 1 a rank failed, 2 the flags cannot run)."""
    try:
        o = options(flags)
        return _parent(o)
    except UsageError as e:
        print(f"memsaver bench nccl: error: {e}", file=sys.stderr)
        return 2
    except BenchError as e:
        print(f"memsaver bench nccl: error: {e}", file=sys.stderr)
        return 1


# --- the parent -------------------------------------------------------------------------------


def _is_fake_driver(path: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(path), "fakecuda_call_counts")
    except OSError:
        return False


def _fake_libraries() -> tuple[str, str]:
    """(the fake driver, the fake NCCL): MEMSAVER_FAKE_CUDA_LIB, else MEMSAVER_CUDA_LIB when it
    names a fake driver, else the one shipped in this package; the fake NCCL as
    :func:`_fake_nccl_library` finds it."""
    from ._core import BUNDLED_LIBRARY

    named = os.environ.get("MEMSAVER_CUDA_LIB", "")
    bundled = os.path.join(os.path.dirname(BUNDLED_LIBRARY), "_fake", "libcuda.so.1")
    cuda = os.environ.get("MEMSAVER_FAKE_CUDA_LIB") or (named if named and _is_fake_driver(named) else bundled)
    if not _is_fake_driver(cuda):
        raise BenchError(f"{cuda} is not memsaver's fake CUDA driver (name one with MEMSAVER_FAKE_CUDA_LIB)")
    return cuda, _fake_nccl_library(os.path.dirname(cuda))


def _fake_nccl_library(cuda_dir: str | None) -> str:
    """The fake NCCL: MEMSAVER_FAKE_NCCL_LIB, else target/fake-nccl/libnccl.so.2 beside a fake
    driver of a checkout (in ``cuda_dir``) or under this directory."""
    env = os.environ.get("MEMSAVER_FAKE_NCCL_LIB")
    if env:
        if not os.path.isfile(env):
            raise BenchError(f"MEMSAVER_FAKE_NCCL_LIB={env}: no such file (build it with `make fake-cuda`)")
        return env
    candidates = [os.path.abspath(os.path.join("target", "fake-nccl", "libnccl.so.2"))]
    if cuda_dir:
        candidates.insert(0, os.path.normpath(os.path.join(cuda_dir, "..", "fake-nccl", "libnccl.so.2")))
    for c in candidates:
        if os.path.isfile(c):
            return c
    raise BenchError(
        "the fake NCCL (tests/fake-nccl) is not shipped in the package: run `make fake-cuda` in a "
        "memsaver checkout and set MEMSAVER_FAKE_NCCL_LIB=<checkout>/target/fake-nccl/libnccl.so.2 "
        f"(looked at: {', '.join(candidates)})"
    )


def _check_gpus(o: Options) -> None:
    """Fails at once where the ranks could not run: no torch, too few GPUs, --native on an
    NCCL without ncclCommSuspend."""
    try:
        import torch
    except ImportError as e:
        raise BenchError(f"the GPU benchmark needs torch ({e}); without a GPU, run it with --fake") from None
    n = torch.cuda.device_count()
    if n < o.ranks:
        raise BenchError(f"--ranks {o.ranks} needs {o.ranks} GPUs (one per rank); {n} visible")
    if o.native:
        found = _loaded_nccl_version()
        if found < NATIVE_MIN:
            raise UsageError(
                f"--native needs NCCL {'.'.join(map(str, NATIVE_MIN))} or later (ncclCommSuspend/"
                f"ncclCommResume); torch's NCCL is {'.'.join(map(str, found))}: load a newer "
                "libnccl.so.2 first (LD_PRELOAD=<path>/libnccl.so.2)"
            )


def _loaded_nccl_version() -> tuple[int, ...]:
    """The version of the NCCL this process runs (torch imported): the libnccl.so.2 loaded, which
    may be a preloaded one newer than the NCCL torch was built with (``torch.cuda.nccl.version``)."""
    code = ctypes.c_int()
    if ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(code)) != 0:
        raise BenchError("ncclGetVersion failed")
    return nccl_version(code.value)


def nccl_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s code as (major, minor, patch): 22809 is 2.28.9 (from 2.9 on), 2708
    is 2.7.8 (before)."""
    if code >= 10000:
        return (code // 10000, code // 100 % 100, code % 100)
    return (code // 1000, code // 100 % 10, code % 100)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parent(o: Options) -> int:
    from . import _launch

    if o.native and (o.fake or o.fake_nccl):
        raise UsageError("--native measures NCCL's own ncclCommSuspend/ncclCommResume, which the fake NCCL lacks")
    env = dict(os.environ)
    if not o.native:  # native: NCCL alone, memsaver not loaded in the ranks
        env.update(_launch.subprocess_env())
    work = tempfile.mkdtemp(prefix="memsaver-bench-nccl.")
    try:
        config: dict[str, Any] = dataclasses.asdict(o)
        config["dir"] = work
        if o.fake:
            cuda, nccl = _fake_libraries()
            config["nccl"] = nccl
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else work
            state = tempfile.mkdtemp(prefix="memsaver-bench-nccl.", dir=shm)
            runtime = os.path.join(work, "runtime")
            os.mkdir(runtime, 0o700)
            # One fresh fake machine for the ranks, and a runtime directory of their own (no
            # other job's processes in their group).
            env.update(MEMSAVER_CUDA_LIB=cuda, FAKE_CUDA_DIR=state, MEMSAVER_RUNTIME_DIR=runtime)
        elif o.fake_nccl:
            config["nccl"] = _fake_nccl_library(None)
            state = ""
            env.pop("MEMSAVER_CUDA_LIB", None)  # this machine's driver
        else:
            _check_gpus(o)
            state = ""
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(o.ranks))
        try:
            return _run_ranks(o, config, env)
        finally:
            if state:
                shutil.rmtree(state, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_ranks(o: Options, config: dict[str, Any], env: dict[str, str]) -> int:
    work = config["dir"]
    procs = []
    for r in range(o.ranks):
        out = open(os.path.join(work, f"rank{r}.out"), "w+")  # noqa: SIM115 - closed below
        err = open(os.path.join(work, f"rank{r}.err"), "w+")  # noqa: SIM115
        cmd = [sys.executable, "-m", "memsaver._bench_nccl", json.dumps(dict(config, rank=r))]
        procs.append((subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=out, stderr=err),
                      out, err))
    deadline = time.monotonic() + o.timeout
    problems: list[str] = []
    while any(p.poll() is None for p, _, _ in procs):
        failed = [(r, p.returncode) for r, (p, _, _) in enumerate(procs) if p.returncode not in (None, 0)]
        late = time.monotonic() > deadline
        if failed or late:
            for r, (p, _, _) in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    problems.append(
                        f"rank {r} did not finish within {o.timeout:g} s (killed)"
                        if late
                        else f"rank {r} stopped after rank {failed[0][0]} failed"
                    )
            break
        time.sleep(0.02)
    lines: list[str] = []
    errors: list[str] = []
    for r, (p, out, err) in enumerate(procs):
        out.seek(0)
        err.seek(0)
        mine = [line.rstrip("\n") for line in out if line.startswith(LINE)]
        text = err.read()
        out.close()
        err.close()
        if p.returncode not in (0, -9) or (p.returncode == 0 and len(mine) != 1):
            said = [line for line in text.splitlines() if line.startswith(f"rank {r}:")]
            problems.insert(0, said[-1] if said else f"rank {r} failed (exit status {p.returncode})")
        # A failed rank's stderr, and every rank's when logs were asked for (MEMSAVER_LOG).
        if (p.returncode != 0 or env.get("MEMSAVER_LOG")) and text.strip():
            errors += [f"[rank {r}] {line}" for line in text.rstrip("\n").splitlines()]
        lines += mine
    if problems:
        for line in errors:
            print(line, file=sys.stderr)
        for line in problems:
            print(f"memsaver bench nccl: {line}", file=sys.stderr)
        return 1
    for line in errors:
        print(line, file=sys.stderr)
    for line in lines:
        print(line)
    return 0


# --- a rank -----------------------------------------------------------------------------------


class FileBarrier:
    """All ranks wait for each other through files in the run's directory (no NCCL: it may be
    paused); each call also hands every rank what each one passed (an all-gather)."""

    def __init__(self, directory: str, rank: int, world: int, deadline: float) -> None:
        self.dir, self.rank, self.world, self.deadline = directory, rank, world, deadline
        self.generation = 0

    def __call__(self, value: Any = None) -> list[Any]:
        self.generation += 1
        name = os.path.join(self.dir, f"barrier.{self.generation}.")
        with open(name + f"{self.rank}.tmp", "w") as f:
            json.dump(value, f)
        os.rename(name + f"{self.rank}.tmp", name + str(self.rank))
        got: list[Any] = [None] * self.world
        missing = set(range(self.world))
        while missing:
            for r in list(missing):
                try:
                    with open(name + str(r)) as f:
                        got[r] = json.load(f)
                    missing.discard(r)
                except FileNotFoundError:
                    pass
            if missing:
                if time.monotonic() > self.deadline:
                    raise BenchError(f"ranks {sorted(missing)} did not reach barrier {self.generation} in time")
                time.sleep(0.0005)
        return got


def _vmm_calls(before: dict[str, int], after: dict[str, int]) -> int:
    return sum(after.get(k, 0) - before.get(k, 0) for k in VMM_KINDS)


@dataclasses.dataclass
class Workload:
    """What the cycles need of a mode: its set-up is done when it is made."""

    check: Callable[[int], None]  # the collectives are right after resume N (0: warm-up)
    free_bytes: Callable[[], int]  # the device's free memory, work finished
    barrier: FileBarrier
    shared_device: bool  # ranks share one device (the fake): free memory is all ranks'
    switch: Callable[[], Switch]  # made once the communicators are warm


@dataclasses.dataclass
class Switch:
    """How a mode frees NCCL's memory and brings it back."""

    pause: Callable[[], None]
    resume: Callable[[], None]
    owned: Callable[[], int]  # the bytes a pause should free in this rank
    calls: Callable[[], dict[str, int]] | None  # driver calls so far, by kind (None: not counted)
    # bytes the last pause and the last resume copied to and from backups (None: not counted)
    copied: Callable[[], tuple[int, int]] | None = None


def _nccl_owned_bytes() -> int:
    import memsaver

    owned = memsaver.nccl_stats()["owned_bytes"]
    return owned if isinstance(owned, int) else 0


def _memsaver_switch() -> Switch:
    import memsaver

    if memsaver.nccl_stats()["owned_bytes"] in (0, None):
        raise BenchError(
            "NCCL allocated nothing through memsaver's hook (nccl_stats owned_bytes is 0): is the "
            f"rank preloaded? hook mode {memsaver.hook_mode()}"
        )
    return Switch(
        pause=lambda: memsaver.pause("nccl"),
        resume=lambda: memsaver.resume("nccl"),
        owned=_nccl_owned_bytes,
        calls=lambda: memsaver.stats().driver_calls,
        copied=_copied_bytes,
    )


def _copied_bytes() -> tuple[int, int]:
    import memsaver

    s = memsaver.nccl_stats()
    pause, resume = s["bytes_copied_per_pause"], s["bytes_copied_per_resume"]
    if not isinstance(pause, int) or not isinstance(resume, int):
        raise BenchError(f"nccl_stats() has no byte counts of copies: {s}")
    return pause, resume


def _native_switch(comms: list[int]) -> Switch:
    """NCCL's own suspend and resume of each communicator (``comms``: their ``ncclComm_t``)."""
    nccl = ctypes.CDLL("libnccl.so.2")  # the one torch loaded (same soname)
    for f in (nccl.ncclCommSuspend, nccl.ncclCommResume, nccl.ncclCommMemStats):
        f.restype = ctypes.c_int
    nccl.ncclCommSuspend.argtypes = [ctypes.c_void_p, ctypes.c_int]
    nccl.ncclCommResume.argtypes = [ctypes.c_void_p]
    nccl.ncclCommMemStats.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    suspend_mem, gpu_mem_suspend = 0x01, 0  # NCCL_SUSPEND_MEM, ncclStatGpuMemSuspend

    def each(what: str, call: Callable[[int], int]) -> None:
        for c, comm in enumerate(comms):
            rc = call(comm)
            if rc != 0:
                raise BenchError(f"communicator {c}: {what} failed (ncclResult {rc})")

    def owned() -> int:
        total = 0
        for c, comm in enumerate(comms):
            v = ctypes.c_uint64()
            rc = nccl.ncclCommMemStats(comm, gpu_mem_suspend, ctypes.byref(v))
            if rc != 0:
                raise BenchError(f"communicator {c}: ncclCommMemStats failed (ncclResult {rc})")
            total += v.value
        return total

    return Switch(
        pause=lambda: each("ncclCommSuspend", lambda comm: nccl.ncclCommSuspend(comm, suspend_mem)),
        resume=lambda: each("ncclCommResume", nccl.ncclCommResume),
        owned=owned,
        calls=None,
    )


def _cycles(rank: int, o: Options, w: Workload) -> dict[str, Any]:
    s = w.switch()
    snap = s.calls or dict  # native: nothing counted
    pause_ms: list[float] = []
    resume_ms: list[float] = []
    calls: tuple[int | None, int | None] = (None, None)
    first_calls: int | None = None
    copied: tuple[int | None, int | None] = (None, None)
    freed_pct = 0.0
    for k in range(1, o.cycles + 1):
        owned = s.owned()
        w.barrier()
        free0 = w.free_bytes()
        owned_all = w.barrier(owned)
        c0 = snap()
        t0 = time.perf_counter()
        s.pause()
        pause_ms.append((time.perf_counter() - t0) * 1e3)
        c1 = snap()
        w.barrier()  # every rank has paused
        freed = w.free_bytes() - free0
        whose = sum(owned_all) if w.shared_device else owned
        freed_pct = round(100.0 * freed / whose, 1) if whose else 0.0
        w.barrier()
        c2 = snap()
        t0 = time.perf_counter()
        s.resume()
        resume_ms.append((time.perf_counter() - t0) * 1e3)
        c3 = snap()
        if s.calls:
            calls = (_vmm_calls(c0, c1), _vmm_calls(c2, c3))
            if k == 1:
                first_calls = calls[0]
        if s.copied:
            copied = s.copied()
        w.barrier()  # every rank has resumed
        w.check(k)
    return {
        "rank": rank,
        "ranks": o.ranks,
        "comms": o.comms,
        "mode": "native" if o.native else "memsaver",
        "pause_ms": [round(t, 3) for t in pause_ms],
        "resume_ms": [round(t, 3) for t in resume_ms],
        "calls_per_pause": calls[0],
        "calls_per_resume": calls[1],
        "calls_first_pause": first_calls,
        "bytes_copied_per_pause": copied[0],
        "bytes_copied_per_resume": copied[1],
        "freed_pct": freed_pct,
    }


class FakeNcclAlloc(ctypes.Structure):
    """What one allocation of the fake NCCL did (tests/fake-nccl/src/lib.rs)."""

    get_proc_address: int
    mem_create: int
    handle: int
    ptr: int
    size: int
    exported_fd: int

    _fields_ = [
        ("get_proc_address", ctypes.c_size_t),
        ("mem_create", ctypes.c_size_t),
        ("handle", ctypes.c_uint64),
        ("ptr", ctypes.c_uint64),
        ("size", ctypes.c_size_t),
        ("exported_fd", ctypes.c_int),
    ]


def _pattern(key: str, size: int) -> bytes:
    """``size`` bytes (a multiple of 4 KiB) that only ``key`` gives."""
    block = b"".join(hashlib.sha256(f"{key}/{i}".encode()).digest() for i in range(128))
    return block * (size // len(block))


def _private(key: str, size: int) -> bytes:
    """``size`` bytes shaped as one of NCCL's private buffers: 3 KiB of structures at the start,
    100 bytes near the end, zeros between (NCCL rounds each small structure up to a granule)."""
    out = bytearray(size)
    live = _pattern(key, 4096)
    out[:3072] = live[:3072]
    out[size - 4089 : size - 3989] = live[3072:3172]
    return bytes(out)


def _shared_bytes_kept() -> int:
    """The bytes at the start of a buffer NCCL shares that a resume restores, by the backup
    policy in force (``MEMSAVER_NCCL_BACKUP``): its header with ``headers`` (the default: what
    NCCL needs of it across collectives), nothing with ``discard``, else all."""
    policy = os.environ.get("MEMSAVER_NCCL_BACKUP", "").strip() or "headers"
    return {"headers": 64 << 10, "discard": 0}.get(policy, 1 << 62)


def _fake_workload(rank: int, o: Options, cfg: dict[str, Any], barrier: FileBarrier) -> Workload:
    import memsaver

    # --fake: the fake driver the parent named; --fake-nccl: this machine's.
    cuda_path = os.environ["MEMSAVER_CUDA_LIB"] if o.fake else "libcuda.so.1"
    cuda_b = cuda_path.encode()
    cuda = ctypes.CDLL(cuda_path)
    ctx = ctypes.c_void_p()
    # Device 0's primary context current on this thread, as NCCL's callers have it.
    for what, rc in (
        ("cuInit", cuda.cuInit(0)),
        ("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)),
        ("cuCtxPushCurrent", cuda.cuCtxPushCurrent_v2(ctx)),
    ):
        if rc != 0:
            raise BenchError(f"{what} failed on the CUDA driver {cuda_path} (CUDA error {rc})")
    cuda.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
    cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]

    def put(ptr: int, data: bytes) -> None:
        rc = cuda.cuMemcpyHtoD_v2(ptr, data, len(data))
        if rc != 0:
            raise BenchError(f"writing {len(data)} bytes at {ptr:#x} failed (CUDA error {rc})")

    def get(ptr: int, n: int) -> bytes:
        out = ctypes.create_string_buffer(n)
        rc = cuda.cuMemcpyDtoH_v2(out, ptr, n)
        if rc != 0:
            raise BenchError(f"reading {n} bytes at {ptr:#x} failed (CUDA error {rc})")
        return out.raw

    nccl = ctypes.CDLL(cfg["nccl"])
    ptr = ctypes.POINTER(FakeNcclAlloc)
    nccl.fake_nccl_alloc.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ptr]
    nccl.fake_nccl_import.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t, ptr]
    nccl.fake_nccl_comm_init.argtypes = [ctypes.c_char_p, ctypes.c_int]
    nccl.ncclAllReduce.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_int] + [
        ctypes.c_void_p
    ] * 2

    def alloc(size: int, export: bool) -> FakeNcclAlloc:
        a = FakeNcclAlloc()
        rc = nccl.fake_nccl_alloc(cuda_b, size, int(export), ctypes.byref(a))
        if rc != 0:
            raise BenchError(f"the fake NCCL could not allocate {size} bytes (CUDA error {rc})")
        return a

    peers = [p for p in range(o.ranks) if p != rank]
    private: list[FakeNcclAlloc] = []
    exported: dict[int, list[FakeNcclAlloc]] = {p: [] for p in peers}  # per peer, by communicator
    for _ in range(o.comms):
        # "NCCL's kernel" and its stack are the fake driver's (a real driver has no such call).
        if o.fake and nccl.fake_nccl_comm_init(cuda_b, o.ranks) != 0:
            raise BenchError("the fake NCCL could not set up a communicator")
        private += [alloc(2 * MIB, False) for _ in range(o.buffers)]
        for p in peers:
            exported[p].append(alloc(o.mib * MIB, True))
            private.append(alloc(2 * MIB, False))
    for i, a in enumerate(private):
        put(a.ptr, _private(f"private/{rank}/{i}", a.size))
    for p in peers:
        for c, a in enumerate(exported[p]):
            put(a.ptr, _pattern(f"shared/{rank}->{p}/{c}", a.size))
    imports = _exchange(rank, o, cfg["dir"], exported, nccl, cuda_b, barrier)
    # Digests, not copies: at 16 communicators of 320 buffers a rank holds 10 GiB of them.
    expected = {i: hashlib.sha256(_private(f"private/{rank}/{i}", a.size)).digest() for i, a in enumerate(private)}
    kept = _shared_bytes_kept()

    def check(step: int) -> None:
        when = "warm-up" if step == 0 else f"resume {step}"
        for c in range(o.comms):
            a = exported[peers[0]][c]
            if nccl.ncclAllReduce(a.ptr, a.ptr, a.size, 0, 0, None, None) != 0:
                raise BenchError(f"communicator {c}: ncclAllReduce failed after {when}")
        for (p, c), a in imports.items():  # the all-to-all: every peer's buffer, read here
            n = min(a.size, kept)
            if get(a.ptr, n) != _pattern(f"shared/{p}->{rank}/{c}", a.size)[:n]:
                raise BenchError(f"communicator {c}: the buffer rank {p} shares is wrong after {when}")
        for i, a in enumerate(private):
            if hashlib.sha256(get(a.ptr, a.size)).digest() != expected[i]:
                raise BenchError(f"private buffer {i} ({a.size} bytes at {a.ptr:#x}) changed after {when}")

    return Workload(check, lambda: memsaver.device_memory(0)[0], barrier, True, _memsaver_switch)


def _exchange(
    rank: int,
    o: Options,
    directory: str,
    exported: dict[int, list[FakeNcclAlloc]],
    nccl: ctypes.CDLL,
    cuda_b: bytes,
    barrier: FileBarrier,
) -> dict[tuple[int, int], FakeNcclAlloc]:
    """Sends each peer the fds (memsaver tokens) of its buffers, as NCCL's proxy does, and
    imports theirs; the imports by (peer, communicator)."""
    path = os.path.join(directory, f"x{rank}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(o.ranks)
    barrier()  # every rank listens
    sent: list[BaseException] = []

    def send() -> None:
        try:
            for p, bufs in exported.items():
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(os.path.join(directory, f"x{p}.sock"))
                    payload = struct.pack("<I", rank) + b"".join(struct.pack("<Q", a.size) for a in bufs)
                    socket.send_fds(s, [payload], [a.exported_fd for a in bufs])
        except BaseException as e:  # noqa: BLE001 - reported by the receiving thread
            sent.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    imports: dict[tuple[int, int], FakeNcclAlloc] = {}
    listener.settimeout(max(1.0, barrier.deadline - time.monotonic()))
    for _ in range(o.ranks - 1):
        conn, _ = listener.accept()
        with conn:
            payload, fds, _, _ = socket.recv_fds(conn, 4 + 8 * MAX_FDS, MAX_FDS)
        (peer,) = struct.unpack_from("<I", payload)
        sizes = [s for (s,) in struct.iter_unpack("<Q", payload[4:])]
        if len(sizes) != len(fds) or len(fds) != o.comms:
            raise BenchError(f"rank {peer} sent {len(fds)} fds and {len(sizes)} sizes, not {o.comms}")
        for c, (fd, size) in enumerate(zip(fds, sizes, strict=True)):
            a = FakeNcclAlloc()
            rc = nccl.fake_nccl_import(cuda_b, fd, size, ctypes.byref(a))  # it closes the fd
            if rc != 0:
                raise BenchError(f"communicator {c}: cannot import the buffer of rank {peer} (error {rc})")
            imports[(peer, c)] = a
    sender.join()
    listener.close()
    if sent:
        raise BenchError(f"cannot send this rank's buffers to its peers: {sent[0]}")
    for bufs in exported.values():
        for a in bufs:  # NCCL closes its copy once every peer has it
            os.close(a.exported_fd)
            a.exported_fd = -1
    return imports


def _gpu_workload(rank: int, o: Options, barrier: FileBarrier) -> Workload:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", rank=rank, world_size=o.ranks)  # no NCCL in the default group
    everyone = list(range(o.ranks))
    groups = [dist.new_group(ranks=everyone, backend="nccl") for _ in range(o.comms)]
    n = o.mib * MIB // 4
    chunk = max(1, n // o.ranks)

    def check(step: int) -> None:
        when = "warm-up" if step == 0 else f"resume {step}"
        for c, g in enumerate(groups):
            x = torch.full((n,), float(rank + step + c), device="cuda")
            dist.all_reduce(x, group=g)
            want = float(sum(r + step + c for r in everyone))
            if not bool(torch.all(x == want).item()):
                raise BenchError(f"communicator {c}: all_reduce gave {x[0].item()} after {when}, expected {want}")
            src = torch.arange(o.ranks, device="cuda", dtype=torch.float32).repeat_interleave(chunk) + rank * o.ranks
            out = torch.empty_like(src)
            dist.all_to_all_single(out, src, group=g)
            want_a2a = torch.arange(o.ranks, device="cuda", dtype=torch.float32).repeat_interleave(chunk) * o.ranks
            if not bool(torch.all(out == want_a2a + rank).item()):
                raise BenchError(f"communicator {c}: all_to_all gave wrong chunks after {when}")
        torch.cuda.synchronize()

    def free_bytes() -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info()[0])

    def native() -> Switch:
        return _native_switch([int(g._get_backend(torch.device("cuda"))._comm_ptr()) for g in groups])

    return Workload(check, free_bytes, barrier, False, native if o.native else _memsaver_switch)


def _rank(cfg: dict[str, Any]) -> None:
    rank = int(cfg["rank"])
    o = Options(**{f.name: cfg[f.name] for f in dataclasses.fields(Options)})
    if not o.native:
        import memsaver

        if memsaver.hook_mode() != "preload":
            raise BenchError(
                f"memsaver is not preloaded here (hook mode {memsaver.hook_mode()}): NCCL would not be hooked"
            )
    barrier = FileBarrier(cfg["dir"], rank, o.ranks, time.monotonic() + o.timeout)
    fake_nccl = o.fake or o.fake_nccl
    w = _fake_workload(rank, o, cfg, barrier) if fake_nccl else _gpu_workload(rank, o, barrier)
    w.check(0)
    report = _cycles(rank, o, w)
    barrier()
    print(LINE + json.dumps(report), flush=True)
    if not fake_nccl:
        import torch.distributed as dist

        dist.destroy_process_group()


def _rank_main(argv: list[str]) -> int:
    """A rank: ``python -m memsaver._bench_nccl CONFIG`` (JSON, from the parent)."""
    config = json.loads(argv[0])
    try:
        _rank(config)
    except BenchError as e:  # every failure of a rank is one line naming it
        print(f"rank {config['rank']}: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # noqa: BLE001 - unforeseen: the traceback too
        import traceback

        traceback.print_exc()
        print(f"rank {config['rank']}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
