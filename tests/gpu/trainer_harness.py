"""What the trainer checks (megatron_trainer.py, deepspeed_trainer.py) share.

Each check runs one trainer three ways, each under torchrun in processes of its own, with the
same seed and data:

* ``none``: trains on, nothing offloaded (the numbers every other run must reproduce);
* ``framework``: what the framework offers today between steps (Megatron: the states copied to
  the CPU storage by storage and the NCCL communicators destroyed and rebuilt, as slime and
  verl do; DeepSpeed: ``engine.offload_states()`` / ``reload_states()``, as OpenRLHF does);
* ``memsaver``: the trainer's tags and ``nccl`` paused and resumed, under the preload.

In the two runs that free memory, a second process on each GPU (the *borrower*, started
without the preload) takes 90% of what was freed while the trainer is offloaded, writes a
pattern into all of it, checks it and frees it, as a rollout engine would. Then the trainer
reloads and trains on. The driver compares the losses and a digest of the final parameters and
optimizer state of every rank across the three runs (bit-identical, or the check fails), and
prints the figures: footprint beyond the CUDA context, freed bytes (by cudaMemGetInfo, and per
tag by memsaver's stats), offload and reload times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
BORROW_SHARE = 0.9  # of the freed bytes, taken by the borrower
MODES = ("none", "framework", "memsaver")
# The run's shape, the same in every trainer check: seed, tokens per sequence, sequences per
# step and rank, vocabulary.
SEED = 1234
SEQ = 256
MICRO_BATCH = 4
VOCAB = 32000

# The borrower: one process per GPU, without memsaver, that takes memory on request, fills it
# with a pattern, checks the pattern and frees it again.
_BORROWER = r"""
import sys, time, torch
dev = torch.device("cuda", int(sys.argv[1]))
torch.cuda.set_device(dev)
torch.zeros(1, device=dev)
print("ready", flush=True)
for line in sys.stdin:
    n, seed = (int(x) for x in line.split())
    try:
        t0 = time.perf_counter()
        words = n // 4
        buf = torch.empty(words, dtype=torch.int32, device=dev)
        buf.copy_(torch.arange(words, dtype=torch.int32, device=dev) ^ seed)
        ok = bool(torch.equal(buf, torch.arange(words, dtype=torch.int32, device=dev) ^ seed))
        del buf
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        print(f"{'ok' if ok else 'bad'} {time.perf_counter() - t0:.4f}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which fails the check
        print(f"err {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        torch.cuda.empty_cache()
"""


class Borrower:
    """The second process on this rank's GPU (see the module's doc)."""

    def __init__(self, device: int) -> None:
        env = {k: v for k, v in os.environ.items()
               if k != "LD_PRELOAD" and not k.startswith(("MEMSAVER_", "TMS_"))}
        self.proc = subprocess.Popen([sys.executable, "-c", _BORROWER, str(device)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, what: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith(what):
            raise RuntimeError(f"borrower: expected {what!r}, got {line!r}")
        return line

    def take(self, nbytes: int, seed: int) -> float:
        """Takes `nbytes`, writes and checks them, frees them; the seconds it took."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{nbytes} {seed}\n")
        self.proc.stdin.flush()
        return float(self._expect("ok").split()[1])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def start_rank(args: argparse.Namespace) -> tuple[int, int, Borrower | None, CycleLog]:
    """A torchrun worker's start: its rank and GPU (CUDA context made), the borrower beside it
    (none in mode `none`), and its log, which records the context's size first."""
    import torch

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.zeros(1, device="cuda")
    borrower = Borrower(local) if args.mode != "none" else None
    log = CycleLog(args.mode, local)
    log.extra["context_bytes"] = device_used(local)
    return rank, local, borrower, log


def device_used(device: int) -> int:
    import torch

    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def digest(tensors: Iterable[Any]) -> str:
    """sha256 over the bytes of `tensors`, in order (copied to the host)."""
    import torch

    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            continue
        b = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
        h.update(b)
    return h.hexdigest()


def optimizer_tensors(opt: Any) -> list[Any]:
    """The parameters and state tensors of a torch optimizer, in a fixed order."""
    import torch

    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(p)
            state = opt.state.get(p, {})
            out.extend(v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor))
    return out


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every trainer check takes (`doc`: its module doc), and the worker's own."""
    p = argparse.ArgumentParser(description=doc.splitlines()[1])
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def passthrough(args: argparse.Namespace, *extra: str) -> list[str]:
    """The driver's options for its workers: the common ones and `extra` (option names)."""
    out = []
    for name in ("cycles", "layers", "hidden", *extra):
        out += [f"--{name}", str(getattr(args, name))]
    return out


class CycleLog:
    """What one rank records per cycle; written as JSON for the driver."""

    def __init__(self, mode: str, device: int) -> None:
        self.mode = mode
        self.device = device
        self.rows: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.extra: dict[str, Any] = {}

    def offload_cycle(self, cycle: int, offload: Callable[[], dict[str, Any]],
                      reload: Callable[[], dict[str, Any]], borrower: Borrower | None) -> None:
        """Offloads, lets the borrower take 90% of what was freed, reloads; records it all."""
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = device_used(self.device)
        t0 = time.perf_counter()
        info = offload()
        torch.cuda.synchronize()
        t_off = time.perf_counter() - t0
        freed = before - device_used(self.device)
        borrowed = int(BORROW_SHARE * freed) & ~(MIB - 1)
        t_borrow = borrower.take(borrowed, 0x5A5A0000 + cycle) if borrower and borrowed else 0.0
        t0 = time.perf_counter()
        info.update(reload())
        torch.cuda.synchronize()
        t_on = time.perf_counter() - t0
        self.rows.append(dict(cycle=cycle, used_before=before, freed=freed, borrowed=borrowed,
                              offload_s=t_off, reload_s=t_on, borrow_s=t_borrow, **info))

    def train(self, args: argparse.Namespace, rank: int, step: Callable[[int], float],
              offload: Callable[[], dict[str, Any]], reload: Callable[[], dict[str, Any]],
              borrower: Borrower | None,
              after_first: Callable[[], None] | None = None) -> None:
        """`args.cycles` cycles of one training step then (but in mode `none`) an offload
        cycle, and one more step after the last reload; `after_first` runs after the first
        step."""
        for cycle in range(args.cycles):
            self.losses.append(step(cycle))
            if cycle == 0 and after_first is not None:
                after_first()
            if args.mode != "none":
                self.offload_cycle(cycle, offload, reload, borrower)
                print(f"rank {rank} cycle {cycle}: loss {self.losses[-1]:.6f} {self.rows[-1]}",
                      flush=True)
        self.losses.append(step(args.cycles))

    def finish(self, args: argparse.Namespace, rank: int, handles: list[int],
               borrower: Borrower | None, **final: Any) -> None:
        """Checks a memsaver run's pauses, writes this rank's results for the driver."""
        failures = memsaver_failures(self.rows, handles) if args.mode == "memsaver" else []
        if args.mode == "memsaver":
            self.extra["nccl_handles"] = handles
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(dict(mode=self.mode, losses=self.losses, cycles=self.rows,
                           failures=failures, **self.extra, **final), f)
        if borrower is not None:
            borrower.close()


def memsaver_offload(ms: Any, tags: tuple[str, ...], pause: Callable[[], Any],
                     handles: list[int]) -> dict[str, Any]:
    """Runs `pause` (which pauses `tags` and `nccl`), recording what each held just before and
    what the `nccl` pause did; appends NCCL's buffer count to `handles`."""
    stats = ms.stats()
    resident = {t: stats.tags[t].resident_bytes for t in tags}
    n = ms.nccl_stats()
    resident["nccl"] = int(n["owned_bytes"]) - int(n["resident_pinned_bytes"])
    handles.append(int(n["owned_handles"]))
    pause()
    n = ms.nccl_stats()
    return dict(tag_resident=resident, stack_lowered=int(n["stack_lowered_bytes"]),
                nccl_unreleased=resident["nccl"] - int(n["paused_bytes"]))


def memsaver_failures(rows: list[dict[str, Any]], handles: list[int]) -> list[str]:
    """A memsaver run's pauses: each tag held memory, the device got back >= FLOOR of it (with
    the kernel stack the `nccl` pause lowered: nccl_floor.py), the hook released all of NCCL's
    memory, and NCCL's buffers stayed the same from the first cycle to the last (no communicator
    rebuilt)."""
    from nccl_floor import FLOOR

    out = []
    if len(set(handles)) != 1:
        out.append(f"NCCL's buffers changed between cycles ({handles}): a communicator was rebuilt")
    for row in rows:
        resident = row["tag_resident"]
        for tag, n in resident.items():
            if n <= 0:
                out.append(f"cycle {row['cycle']}: tag {tag} held nothing (a region or the preload missing?)")
        expected = sum(resident.values()) + row["stack_lowered"]
        if row["freed"] < FLOOR * expected:
            out.append(f"cycle {row['cycle']}: freed {row['freed'] / MIB:.1f} MiB, less than "
                       f"{FLOOR:.0%} of the {expected / MIB:.1f} MiB the paused tags held")
        if row["nccl_unreleased"]:
            out.append(f"cycle {row['cycle']}: {row['nccl_unreleased'] / MIB:.1f} MiB of NCCL's "
                       "memory not released by the hook")
    return out


def run_mode(script: str, mode: str, args: list[str], workdir: str, nproc: int,
             env_extra: dict[str, str]) -> list[dict[str, Any]]:
    """Runs `script --worker` under torchrun in `mode`; the ranks' JSON results."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", **env_extra)
    if mode == "memsaver":
        import memsaver

        env.update(memsaver.subprocess_env())
    out = os.path.join(workdir, mode)
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(29500 + MODES.index(mode)), script, "--worker", "--mode", mode,
           "--out", out, *args]
    print(f"== {mode}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env).returncode
    print(f"== {mode}: exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
    if rc != 0:
        raise SystemExit(f"FAIL {mode}: torchrun exited {rc}")
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(nproc)]


def compare(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every mode's losses and digests equal to the `none` run's, rank by rank."""
    failures = []
    ref = results["none"]
    for mode, ranks in results.items():
        for r, (a, b) in enumerate(zip(ref, ranks, strict=True)):
            if a["losses"] != b["losses"]:
                failures.append(f"{mode} rank {r}: losses {b['losses']} != {a['losses']}")
            for key in ("params", "optimizer"):
                if a[key] != b[key]:
                    failures.append(f"{mode} rank {r}: final {key} differ from the run without offload")
    return failures


def summarize(name: str, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Figures per mode (medians over cycles after the first, mean over ranks), printed."""

    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else 0.0

    summary: dict[str, Any] = {}
    for mode in ("framework", "memsaver"):
        ranks = results[mode]
        rows = [c for rk in ranks for c in rk["cycles"]]
        steady = [c for rk in ranks for c in rk["cycles"][1:]] or rows
        footprint = [c["used_before"] - rk["context_bytes"] for rk in ranks for c in rk["cycles"]]
        s = dict(
            footprint_mib=med(footprint) / MIB,
            freed_mib=med([c["freed"] for c in rows]) / MIB,
            freed_share=med([c["freed"] / max(1, c["used_before"] - rk["context_bytes"])
                             for rk in ranks for c in rk["cycles"]]),
            offload_ms=1e3 * med([c["offload_s"] for c in steady]),
            reload_ms=1e3 * med([c["reload_s"] for c in steady]),
            first_offload_ms=1e3 * max(rk["cycles"][0]["offload_s"] for rk in ranks),
            first_reload_ms=1e3 * max(rk["cycles"][0]["reload_s"] for rk in ranks),
            borrowed_mib=med([c["borrowed"] for c in rows]) / MIB,
        )
        if mode == "memsaver":
            tags: dict[str, list[int]] = {}
            for c in rows:
                for tag, n in c.get("tag_resident", {}).items():
                    tags.setdefault(tag, []).append(n)
            s["tag_resident_mib"] = {t: med(v) / MIB for t, v in tags.items()}
        for key in ("rebuild_ms", "rebuild_groups", "rebuild_freed_mib"):
            vals = [c[key] for c in steady if key in c]
            if vals:
                s[key] = med(vals)
        summary[mode] = s
    print(f"{name}_SUMMARY {json.dumps(summary, sort_keys=True)}", flush=True)
    return summary


def verdict(name: str, results: dict[str, list[dict[str, Any]]]) -> int:
    """Compares the runs, prints the figures and every failure; the exit status."""
    first = results["none"][0]
    print(f"{name}: {first['trainer']}, optimizer {first['optimizer_class']}")
    failures = compare(results)
    for mode in MODES:
        for r, rk in enumerate(results[mode]):
            failures += [f"{mode} rank {r}: {f}" for f in rk["failures"]]
    summarize(name, results)
    for f in failures:
        print(f"FAIL {f}")
    print(f"{name} PASS" if not failures else f"{name} FAIL ({len(failures)} failures)")
    return 1 if failures else 0
