#!/usr/bin/env python3
"""GPU check of CUDA IPC on memsaver memory: torch's CUDA tensor sharing between two processes
on one GPU, both under the preload (``LD_PRELOAD`` of the installed package's libmemsaver.so,
from ``memsaver.subprocess_env()``), across a pause/resume cycle of the owner.

For each mode (``--mode``, default ``all``):

* ``region``: the owner allocates the shared tensor in ``memsaver.region("weights",
  backup="cpu")``;
* ``process``: whole-process mode, ``MEMSAVER_PROCESS_TAG=weights`` with
  ``MEMSAVER_PROCESS_BACKUP=cpu``: every tensor of both processes is memsaver memory.

the owner (this script, re-run under the preload) starts a receiver with
``torch.multiprocessing`` (spawn; it inherits the preload) and:

1. fills a ``--size-mib`` (default 1024) uint8 tensor with a pattern and puts it on a
   ``torch.multiprocessing`` queue (``reduce_tensor``: ``cudaIpcGetMemHandle`` of the segment);
   the receiver reads it (``cudaIpcOpenMemHandle``) and checks the pattern, and its
   ``memsaver.stats().shared_imports`` lists it, not paused; in region mode, a process
   without the preload given the same handle gets an error from the real runtime, never a
   pointer;
2. the owner pauses ``weights``: ``torch.cuda.mem_get_info()`` measured in the owner shows at
   least 90% of the tensor's bytes back (the receiver's mapping was released too, else the
   memory would stay held); the receiver's stats show the import paused;
3. the owner resumes: its contents are back (cpu backup), it writes a new value; the receiver
   sees the new value through the pointer it had (same ``data_ptr()``);
4. the receiver is stopped (SIGSTOP) across a whole pause and resume of the owner: both calls do
   the owner's part and raise ``memsaver.PeerError`` naming the receiver (the owner runs with
   ``MEMSAVER_IPC_TIMEOUT_MS=2000``); the owner writes a new value; once the receiver runs
   again (SIGCONT) it catches up without another cycle (the owner's ``imports_behind`` drops
   to 0) and sees the new value at the same address;
5. region mode only: the time to open (``rebuild_cuda_tensor``, which calls
   ``cudaIpcOpenMemHandle``) a handle of a 1 GiB memsaver tensor against a 1 GiB plain tensor
   shared the same way (allocated outside any region: real CUDA IPC), median of ``--reps``
   (default 5), in the same run. The figures are printed (target: within 2x); they do not
   decide the exit status.

Exit status non-zero on any failure; PASS/FAIL lines and a summary at the end.

Run: ``python3 tests/gpu/ipc_share.py`` on a machine with torch and one GPU, the wheel
installed (``tests/gpu/setup_device.sh``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

TAG = "weights"
MARK_EVERY = 1 << 20


def log(msg: str) -> None:
    print(msg, flush=True)


class Checks:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.failed: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        log(f"{'PASS' if ok else 'FAIL'} [{self.mode}] {what}")
        if not ok:
            self.failed.append(what)


def pattern_ok(torch: Any, x: Any, base: int, mark: int) -> bool:
    """``x`` holds ``base`` everywhere but every ``MARK_EVERY``-th byte, which holds ``mark``."""
    marks = x[::MARK_EVERY]
    n_marks = marks.numel()
    ok_marks = bool(marks.eq(mark).all().item())
    ok_rest = int(x.eq(base).sum().item()) == x.numel() - n_marks
    torch.cuda.synchronize()
    return ok_marks and ok_rest


def fill(x: Any, base: int, mark: int) -> None:
    x.fill_(base)
    x[::MARK_EVERY] = mark


def imports(memsaver: Any) -> list[Any]:
    return list(memsaver.stats().shared_imports)


def receiver(mode: str, size: int, reps: int, inbox: Any, outbox: Any) -> None:
    """The receiving process: everything it sees goes back to the owner on ``outbox``."""
    import gc

    import memsaver
    import torch

    torch.cuda.init()
    try:
        outbox.put(("mode", memsaver.hook_mode()))
        x = inbox.get()  # the shared tensor (cudaIpcOpenMemHandle inside)
        torch.cuda.synchronize()
        ptr = x.data_ptr()
        imp = imports(memsaver)
        outbox.put(("read", pattern_ok(torch, x, 1, 2), len(imp), bool(imp and imp[0].paused)))
        assert inbox.get() == "paused"
        imp = imports(memsaver)
        outbox.put(("paused", len(imp), bool(imp and imp[0].paused)))
        assert inbox.get() == "resumed"
        imp = imports(memsaver)
        outbox.put(("resumed", pattern_ok(torch, x, 7, 9), x.data_ptr() == ptr,
                    bool(imp and not imp[0].paused)))
        # Stopped meanwhile, across the owner's pause and resume.
        assert inbox.get() == "caught-up"
        imp = imports(memsaver)
        outbox.put(("caught-up", pattern_ok(torch, x, 11, 13), x.data_ptr() == ptr,
                    bool(imp and not imp[0].paused)))
        del x
        gc.collect()
        if mode == "region":
            for _ in range(2 * reps + 1):
                kind, (fn, args) = inbox.get()
                t0 = time.perf_counter()
                y = fn(*args)  # rebuild_cuda_tensor: cudaIpcOpenMemHandle
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                ok = int(y[0].item()) == 3
                del y
                gc.collect()
                outbox.put(("open", kind, dt, ok))
        outbox.put(("done",))
    except BaseException as e:  # noqa: BLE001 - reported to the owner, which fails
        outbox.put(("error", repr(e)))


# A receiver without memsaver: the real runtime's cudaIpcOpenMemHandle of memsaver's handle.
PLAIN_RECEIVER = """
import pickle, sys
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
args = pickle.loads(sys.stdin.buffer.read())
try:
    t = rebuild_cuda_tensor(*args)
    print("OPENED", hex(t.data_ptr()))
except Exception as e:
    print("REFUSED", type(e).__name__, str(e).splitlines()[0][:160])
"""


def open_without_memsaver(t: Any) -> tuple[bool, str]:
    """Whether a process without the preload, given the tensor's handle as torch sends it,
    gets an error (and what it said) rather than a pointer."""
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "MEMSAVER_HOOK_MODE", "MEMSAVER_PROCESS_TAG")}
    r = subprocess.run([sys.executable, "-c", PLAIN_RECEIVER], input=pickle.dumps(args),
                       env=env, capture_output=True, timeout=300)
    out = r.stdout.decode(errors="replace").strip() or r.stderr.decode(errors="replace")[-300:]
    return out.startswith("REFUSED"), out


def stopped_receiver(c: Checks, mode: str, memsaver: Any, torch: Any, t: Any, pid: int) -> None:
    """Step 4: the receiver stopped across a whole pause and resume of the owner."""
    import signal

    os.kill(pid, signal.SIGSTOP)
    try:
        for op in (memsaver.pause, memsaver.resume):
            try:
                op(TAG)
                c.check(False, f"{op.__name__} with the receiver stopped reports it")
            except memsaver.PeerError as e:
                c.check(f"process {pid} " in str(e),
                        f"{op.__name__} with the receiver stopped raises PeerError naming it "
                        f"({str(e)[:160]}...)")
        fill(t, 11, 13)
        torch.cuda.synchronize()
    finally:
        os.kill(pid, signal.SIGCONT)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 60:
        e = memsaver.stats().shared_exports.get(TAG)
        if e is not None and e.imports_behind == 0:
            break
        time.sleep(0.01)
    log(f"[{mode}] the stopped receiver caught up {(time.perf_counter() - t0) * 1e3:.0f} ms "
        "after SIGCONT")
    e = memsaver.stats().shared_exports.get(TAG)
    c.check(e is not None and e.imports_behind == 0,
            f"the owner's stats show the receiver caught up ({e})")


def owner(mode: str, size_mib: int, reps: int) -> int:
    import memsaver
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    c = Checks(mode)
    c.check(memsaver.hook_mode() == "preload", "the owner runs under the preload")
    size = size_mib << 20
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(mode, size, reps, inbox, outbox))
    proc.start()

    def answer(kind: str) -> tuple[Any, ...]:
        msg: tuple[Any, ...] = outbox.get(timeout=600)
        if msg[0] == "error":
            raise RuntimeError(f"the receiver failed: {msg[1]}")
        if msg[0] != kind:
            raise RuntimeError(f"the receiver answered {msg!r}, expected {kind}")
        return msg

    try:
        c.check(answer("mode")[1] == "preload", "the receiver runs under the preload")
        if mode == "region":
            with memsaver.region(TAG, backup="cpu"):
                t = torch.empty(size, dtype=torch.uint8, device="cuda")
        else:
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
        fill(t, 1, 2)
        torch.cuda.synchronize()
        inbox.put(t)
        _, read_ok, n_imports, paused = answer("read")
        c.check(read_ok, "the receiver reads the owner's tensor")
        c.check(n_imports == 1 and not paused, "the receiver's stats show one import, not paused")
        exports = memsaver.stats().shared_exports.get(TAG)
        c.check(exports is not None and exports.importers == 1 and exports.bytes >= size,
                f"the owner's stats show the export ({exports})")
        if mode == "region":
            refused, detail = open_without_memsaver(t)
            c.check(refused, f"a receiver without memsaver gets an error, not a pointer ({detail})")

        torch.cuda.synchronize()
        free0, _ = torch.cuda.mem_get_info()
        t0 = time.perf_counter()
        memsaver.pause(TAG)
        pause_ms = (time.perf_counter() - t0) * 1e3
        free1, _ = torch.cuda.mem_get_info()
        log(f"[{mode}] pause: {pause_ms:.1f} ms, {(free1 - free0) / 2**20:.0f} MiB freed")
        c.check(free1 - free0 >= 0.9 * size,
                f"pause frees the shared bytes: {(free1 - free0) / 2**20:.0f} MiB of "
                f"{size_mib} MiB (cudaMemGetInfo in the owner)")
        inbox.put("paused")
        _, n_imports, paused = answer("paused")
        c.check(n_imports == 1 and paused, "the receiver's stats show the import paused")

        t0 = time.perf_counter()
        memsaver.resume(TAG)
        resume_ms = (time.perf_counter() - t0) * 1e3
        free2, _ = torch.cuda.mem_get_info()
        log(f"[{mode}] resume: {resume_ms:.1f} ms")
        c.check(free1 - free2 >= 0.9 * size, "resume maps the memory again")
        c.check(pattern_ok(torch, t, 1, 2), "the owner's contents are back after resume")
        fill(t, 7, 9)
        torch.cuda.synchronize()
        inbox.put("resumed")
        _, sees, same_ptr, mapped = answer("resumed")
        c.check(sees, "the receiver sees the owner's writes after resume")
        c.check(same_ptr, "at the same address")
        c.check(mapped, "the receiver's stats show the import mapped again")

        stopped_receiver(c, mode, memsaver, torch, t, proc.pid)
        inbox.put("caught-up")
        _, sees, same_ptr, mapped = answer("caught-up")
        c.check(sees and same_ptr and mapped,
                "the receiver, stopped across a pause and a resume, sees the owner's new "
                "memory at the same address once it runs")

        if mode == "region":
            times: dict[str, list[float]] = {"memsaver": [], "plain": []}
            # One untimed open first; then plain and memsaver alternate.
            order = ["memsaver"] + ["plain", "memsaver"] * reps
            for i, kind in enumerate(order):
                if kind == "memsaver":
                    with memsaver.region("ipc_bench"):
                        b = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
                else:
                    b = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
                b.fill_(3)
                torch.cuda.synchronize()
                inbox.put((kind, reduce_tensor(b)))
                _, got_kind, dt, ok = answer("open")
                c.check(ok and got_kind == kind, f"open #{i} of a 1 GiB {kind} tensor reads it")
                if i > 0:
                    times[kind].append(dt)
                del b
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            ratio = med["memsaver"] / med["plain"] if med["plain"] > 0 else float("inf")
            log(f"[{mode}] open of a 1 GiB handle (median of {reps}): memsaver "
                f"{med['memsaver']:.2f} ms, plain CUDA IPC {med['plain']:.2f} ms, "
                f"ratio {ratio:.2f} (target: within 2x)")
        answer("done")
    except Exception as e:  # noqa: BLE001 - every failure is reported as one
        c.check(False, f"the exchange completed: {e!r}")
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    c.check(proc.exitcode == 0, f"the receiver exited cleanly (exit code {proc.exitcode})")
    log(f"[{mode}] {'OK' if not c.failed else 'FAILED: ' + '; '.join(c.failed)}")
    return 1 if c.failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["region", "process", "all"], default="all")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return owner(args.mode, args.size_mib, args.reps)

    import memsaver

    results = {}
    for mode in ["region", "process"] if args.mode == "all" else [args.mode]:
        env = {**os.environ, **memsaver.subprocess_env()}
        env.pop("MEMSAVER_PROCESS_TAG", None)
        # Step 4 waits this long for the stopped receiver, twice.
        env["MEMSAVER_IPC_TIMEOUT_MS"] = "2000"
        if mode == "process":
            env["MEMSAVER_PROCESS_TAG"] = TAG
            env["MEMSAVER_PROCESS_BACKUP"] = "cpu"
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode,
               "--size-mib", str(args.size_mib), "--reps", str(args.reps)]
        log(f"=== {mode} mode ===")
        results[mode] = subprocess.run(cmd, env=env, timeout=1800).returncode
    log("summary: " + ", ".join(f"{m}: {'OK' if rc == 0 else f'FAILED ({rc})'}"
                                for m, rc in results.items()))
    return 0 if all(rc == 0 for rc in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
