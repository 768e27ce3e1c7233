#!/usr/bin/env python3
"""What memsaver's background work (pinned backups prepared ahead of the first pause) costs the
application, in one run on one GPU.

Prints, each in its own child process so that one case's memory and threads never touch the
next's:

* allocation of N x SIZE tensors: plain torch, a ``discard`` region, a ``cpu`` region (backups
  prepared in the background), a ``cpu`` region with preparation off
  (``MEMSAVER_BACKUP_PREPARE_MB=0``);
* the delay of kernels launched by another thread while those backups are prepared: the
  longest and the 99th percentile launch-to-completion time of a small matmul, from the first
  allocation until preparation is over, against the same thread with nothing in the background;
* how long preparation took (until ``stats().backups_preparing`` is 0) and at what GiB/s;
* the first pause and resume of the ``cpu`` tag against steady ones, in ms and GB/s;
* the first pause issued immediately after allocating (no wait for preparation: the case
  ``cpu-immediate``) against the steady pause, in ms and as a ratio, with the first resume
  after it, and the steady pause once the rest of the backups has been pinned in the
  background;
* the first pause issued immediately after allocating with a backup reserve
  (``MEMSAVER_BACKUP_RESERVE_MB`` of N x SIZE + 64 MiB: the case ``cpu-reserve``): the process starts
  memsaver, spends ``--load-seconds`` (default 3) as a model load would while the reserve is
  pinned in the background, then allocates and pauses at once; the same figures, with how much
  of the reserve was pinned when the allocation started and the pinning calls made from the
  allocation to the end of the first pause (0 once the reserve is pinned: the check);
* a training step whose activations grow torch's cache, in whole-process mode with cpu backup
  (the preloaded library, ``MEMSAVER_PROCESS_TAG``/``MEMSAVER_PROCESS_BACKUP=cpu``) against the
  same step with no memsaver at all: first step (the cache grows) and a later step.

Usage (from the repository root, memsaver installed, a GPU present):
  python3 bench/background_prepare.py [--n 8] [--size-mib 1024] [--cycles 4] [--load-seconds 3]
      [--cases plain,cpu-immediate,cpu-reserve,...]   (default: every case)
Exits non-zero if a case fails (an error, contents wrong after resume, or a first pause with a
fully pinned reserve that pinned memory).
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

MIB = 1 << 20


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Launcher:
    """Another thread of the application: launches a small matmul and waits for it, in a loop,
    recording each one's launch-to-completion time (ms)."""

    def __init__(self, torch):
        self.torch = torch
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(256, 256, device="cuda")
        self.samples = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        torch = self.torch
        torch.cuda.set_device(0)
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                t = time.perf_counter()
                (self.a @ self.a).sum()
                self.stream.synchronize()
                self.samples.append((time.perf_counter() - t) * 1e3)
                time.sleep(0.001)

    def __enter__(self):
        self.thread.start()
        while not self.samples:
            time.sleep(0.001)
        self.samples.clear()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def case_alloc(kind, n, size, cycles, load_s):
    """One child: allocate n x size in `kind`, with a launcher thread; report as JSON."""
    import torch

    torch.zeros(1, device="cuda")
    out = {"case": kind}
    if kind == "plain":
        ctx = None
    else:
        import memsaver

        policy = "discard" if kind == "discard" else "cpu"
        ctx = lambda: memsaver.region("w", backup=policy)  # noqa: E731
    with Launcher(torch) as idle:
        time.sleep(0.5)
    out["idle_kernel_max_ms"] = max(idle.samples)
    out["idle_kernel_p99_ms"] = pct(idle.samples, 0.99)
    launcher = Launcher(torch)
    with launcher:
        if kind == "cpu-reserve":
            # The process starts memsaver with a CUDA context current: the reserve of
            # MEMSAVER_BACKUP_RESERVE_MB starts pinning now, in the background, while this
            # thread stands for loading a model and another thread launches kernels.
            t = time.perf_counter()
            out["reserve_bytes"] = memsaver.stats().backup_reserve_bytes
            pinned_at = None
            while time.perf_counter() - t < load_s:
                s = memsaver.stats()
                if pinned_at is None and s.backup_reserve_pinned_bytes >= s.backup_reserve_bytes:
                    pinned_at = (time.perf_counter() - t) * 1e3
                time.sleep(0.01)
            s = memsaver.stats()
            out["reserve_pinned_ms"] = float("nan") if pinned_at is None else pinned_at
            out["reserve_pinned_at_alloc"] = s.backup_reserve_pinned_bytes
            out["pinning_calls_before"] = s.driver_calls.get("host_register", 0) + s.driver_calls.get(
                "host_alloc", 0
            )
        each = []

        def alloc():
            s = time.perf_counter()
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            each.append((time.perf_counter() - s) * 1e3)
            return x

        t = time.perf_counter()
        if ctx is None:
            ts = [alloc() for _ in range(n)]
        else:
            with ctx():
                ts = [alloc() for _ in range(n)]
        torch.cuda.synchronize()
        out["alloc_ms"] = (time.perf_counter() - t) * 1e3
        out["alloc_max_ms"] = max(each)
        if _first_pause_at_once(kind):
            # The first pause comes at once: measured below, before preparation is over.
            out["prepare_ms"] = float("nan")
            out["preparing_at_pause"] = memsaver.stats().backups_preparing
        elif kind.startswith("cpu"):
            import memsaver

            while memsaver.stats().backups_preparing:
                time.sleep(0.001)
            out["prepare_ms"] = (time.perf_counter() - t) * 1e3
            out["prepared_backup_bytes"] = memsaver.stats().total.prepared_backup_bytes
        else:
            time.sleep(0.2)
        if _first_pause_at_once(kind):
            # Still inside the launcher: the pause, and the pinning that follows it, run while
            # another thread launches kernels.
            time.sleep(_delay_s(kind))
            first_pause_ms, first_resume_ms = first_cycle_now(memsaver, torch, ts, size, out)
            out["first_pause_ms"], out["first_resume_ms"] = first_pause_ms, first_resume_ms
            t = time.perf_counter()
            while memsaver.stats().backups_preparing:
                time.sleep(0.001)
            out["finish_ms"] = (time.perf_counter() - t) * 1e3
    out["kernel_max_ms"] = max(launcher.samples)
    out["kernel_p99_ms"] = pct(launcher.samples, 0.99)
    out["kernels"] = len(launcher.samples)
    if kind == "cpu-reserve":
        calls = out["pinning_calls_at_pause"] - out["pinning_calls_before"]
        out["pause_pinning_calls"] = calls
        if out["reserve_pinned_at_alloc"] >= n * size and calls:
            raise SystemExit(
                f"the reserve was pinned before allocating, yet {calls} pinning calls were made "
                "from the allocation to the end of the first pause"
            )
    if kind.startswith("cpu"):
        import memsaver

        for i, x in enumerate(ts):
            x.fill_(i % 251)
        gb = n * size / 1e9
        pauses, resumes = [], []
        if _first_pause_at_once(kind):
            pauses.append(out["first_pause_ms"])
            resumes.append(out["first_resume_ms"])
        for _ in range(cycles):
            torch.cuda.synchronize()
            t = time.perf_counter()
            memsaver.pause("w")
            pauses.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            memsaver.resume("w")
            torch.cuda.synchronize()
            resumes.append((time.perf_counter() - t) * 1e3)
        for i, x in enumerate(ts):
            if int(x[size // 2]) != i % 251 or int(x[0]) != i % 251:
                raise SystemExit(f"tensor {i} wrong after resume")
        out["first_pause_ms"], out["first_resume_ms"] = pauses[0], resumes[0]
        out["first_over_steady"] = pauses[0] / min(pauses[1:])
        out["steady_pause_ms"] = min(pauses[1:])
        out["steady_resume_ms"] = min(resumes[1:])
        out["first_pause_gbs"] = gb / pauses[0] * 1e3
        out["steady_pause_gbs"] = gb / out["steady_pause_ms"] * 1e3
        out["steady_resume_gbs"] = gb / out["steady_resume_ms"] * 1e3
    print(json.dumps(out), flush=True)


def _first_pause_at_once(kind):
    """Whether case `kind` pauses before preparation is over: at once (``cpu-immediate``,
    ``cpu-reserve``) or after a delay (``cpu-after-<ms>ms``)."""
    return kind in ("cpu-immediate", "cpu-reserve") or kind.startswith("cpu-after-")


def _delay_s(kind):
    return int(kind.removeprefix("cpu-after-").removesuffix("ms")) / 1e3 if kind.startswith("cpu-after-") else 0.0


def first_cycle_now(memsaver, torch, ts, size, out):
    """The first pause of tag ``w`` right after its allocations (backups still being prepared),
    and the resume after it: (pause ms, resume ms). The tensors are filled first and checked
    after the resume. Notes in `out` the pinning calls made so far, at the end of the pause."""
    for i, x in enumerate(ts):
        x.fill_(i % 251)
    torch.cuda.synchronize()
    t = time.perf_counter()
    memsaver.pause("w")
    pause_ms = (time.perf_counter() - t) * 1e3
    calls = memsaver.stats().driver_calls
    out["pinning_calls_at_pause"] = calls.get("host_register", 0) + calls.get("host_alloc", 0)
    t = time.perf_counter()
    memsaver.resume("w")
    torch.cuda.synchronize()
    resume_ms = (time.perf_counter() - t) * 1e3
    for i, x in enumerate(ts):
        if int(x[size // 2]) != i % 251 or int(x[0]) != i % 251 or int(x[-1]) != i % 251:
            raise SystemExit(f"tensor {i} wrong after the first resume")
    return pause_ms, resume_ms


def case_step(kind, steps):
    """One child: a training step (an MLP whose activations grow torch's cache); per step ms."""
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8192, 8192, device="cuda") for _ in range(8)]
    opt = torch.optim.Adam([p for layer in layers for p in layer.parameters()])
    x = torch.randn(8192, 8192, device="cuda")
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        h = x
        for layer in layers:
            h = torch.relu(layer(h))
        h.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    out = {"case": kind, "first_step_ms": times[0], "later_step_ms": min(times[1:])}
    if kind != "plain-step":
        import memsaver

        while memsaver.stats().backups_preparing:
            time.sleep(0.01)
        out["prepared_backup_bytes"] = memsaver.stats().total.prepared_backup_bytes
    print(json.dumps(out), flush=True)


CASES = ("plain", "discard", "cpu", "cpu-unprepared", "cpu-immediate", "cpu-after-500ms",
         "cpu-after-1000ms", "cpu-after-2000ms", "cpu-reserve", "plain-step", "process-step")


def child(args, kind, env=None):
    cmd = [sys.executable, __file__, "--child", kind, "--n", str(args.n),
           "--size-mib", str(args.size_mib), "--cycles", str(args.cycles),
           "--load-seconds", str(args.load_seconds)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                       timeout=600)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(f"case {kind} failed ({r.returncode})")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--load-seconds", type=float, default=3.0,
                    help="cpu-reserve: seconds between memsaver's start and the allocation")
    ap.add_argument("--cases", default="",
                    help="comma-separated cases to run (default: all): " + ",".join(CASES))
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child in ("plain-step", "process-step"):
        return case_step(args.child, 4)
    if args.child:
        return case_alloc(args.child, args.n, args.size_mib * MIB, args.cycles, args.load_seconds)
    import memsaver

    preload = {"LD_PRELOAD": memsaver.preload_path()}
    cases = [c for c in args.cases.split(",") if c] or list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    # The reserve holds the allocations with a little to spare (torch may round a size up).
    reserve_mb = str(args.n * args.size_mib + 64)
    env = {
        "cpu-unprepared": {"MEMSAVER_BACKUP_PREPARE_MB": "0"},
        "cpu-reserve": {"MEMSAVER_BACKUP_RESERVE_MB": reserve_mb},
        "process-step": {**preload, "MEMSAVER_PROCESS_TAG": "train",
                         "MEMSAVER_PROCESS_BACKUP": "cpu"},
    }
    rows = [child(args, c, env.get(c)) for c in cases if c not in ("plain-step", "process-step")]
    print(f"{args.n} x {args.size_mib} MiB; kernel times are launch to completion of a "
          "256x256 matmul on another thread (ms)")
    print(f"{'case':<16} {'alloc ms':>9} {'1 max':>7} {'kern max':>9} {'kern p99':>9} "
          f"{'idle max':>9} {'prepare ms':>10}")
    for r in rows:
        print(f"{r['case']:<16} {r['alloc_ms']:>9.1f} {r['alloc_max_ms']:>7.1f} "
              f"{r['kernel_max_ms']:>9.2f} "
              f"{r['kernel_p99_ms']:>9.2f} {r['idle_kernel_max_ms']:>9.2f} "
              f"{r.get('prepare_ms', float('nan')):>10.0f}")
    print(f"\n{'case':<16} {'1st pause':>9} {'steady':>9} {'1st/st':>7} {'1st res':>9} "
          f"{'steady':>9} {'pause GB/s':>10} {'res GB/s':>9}")
    for r in rows:
        if not r["case"].startswith("cpu"):
            continue
        print(f"{r['case']:<16} {r['first_pause_ms']:>9.1f} {r['steady_pause_ms']:>9.1f} "
              f"{r['first_pause_ms'] / r['steady_pause_ms']:>7.2f} {r['first_resume_ms']:>9.1f} "
              f"{r['steady_resume_ms']:>9.1f} {r['steady_pause_gbs']:>10.1f} "
              f"{r['steady_resume_gbs']:>9.1f}")
    by_case = {r["case"]: r for r in rows}
    if "cpu-immediate" in by_case:
        im = by_case["cpu-immediate"]
        print(f"\nfirst pause issued immediately after allocating ({im['preparing_at_pause']} "
              f"backups still being prepared): {im['first_pause_ms']:.1f} ms against a steady "
              f"{im['steady_pause_ms']:.1f} ms = {im['first_over_steady']:.2f}x (goal <= 1.5x); "
              f"first resume {im['first_resume_ms']:.1f} ms; the rest pinned in the background "
              f"{im['finish_ms']:.0f} ms later; kernel on another thread meanwhile: max "
              f"{im['kernel_max_ms']:.2f} ms, p99 {im['kernel_p99_ms']:.2f} ms")
    if "cpu-reserve" in by_case:
        rv = by_case["cpu-reserve"]
        print(f"\nwith a backup reserve of {rv['reserve_bytes'] / (1 << 30):.2f} GiB "
              f"(MEMSAVER_BACKUP_RESERVE_MB={reserve_mb}), load stand-in {args.load_seconds:g} s: "
              f"reserve pinned {rv['reserve_pinned_ms']:.0f} ms after start, "
              f"{rv['reserve_pinned_at_alloc'] / (1 << 30):.2f} GiB pinned when allocating; "
              f"allocation {rv['alloc_ms']:.1f} ms; first pause issued immediately "
              f"{rv['first_pause_ms']:.1f} ms against a steady {rv['steady_pause_ms']:.1f} ms = "
              f"{rv['first_over_steady']:.2f}x (goal <= 1.5x); first resume "
              f"{rv['first_resume_ms']:.1f} ms; pinning calls from the allocation to the end of "
              f"the first pause: {rv['pause_pinning_calls']}; kernel on another thread (load, "
              f"allocation and first cycle): max {rv['kernel_max_ms']:.2f} ms, p99 "
              f"{rv['kernel_p99_ms']:.2f} ms")
    steps = [child(args, c, env.get(c)) for c in cases if c in ("plain-step", "process-step")]
    if steps:
        print(f"\n{'training step':<16} {'1st ms':>9} {'later ms':>9} {'prepared GiB':>12}")
        for r in steps:
            print(f"{r['case']:<16} {r['first_step_ms']:>9.1f} {r['later_step_ms']:>9.1f} "
                  f"{r.get('prepared_backup_bytes', 0) / (1 << 30):>12.2f}")
    if len(steps) == 2:
        print(f"whole-process first step / plain: "
              f"{steps[1]['first_step_ms'] / steps[0]['first_step_ms']:.2f}x")


if __name__ == "__main__":
    main()
