#!/usr/bin/env python3
"""GPU check: a process keeps working while its tags are paused, and no allocation lands on
paused memory, in every hook mode (one GPU, torch).

Each scenario runs in its own process:

* ``whole_process`` (preload, ``MEMSAVER_PROCESS_TAG=actor``, ``MEMSAVER_PROCESS_BACKUP=cpu``):
  torch keeps freed blocks cached inside memory that ``pause("actor")`` releases (a 256 MiB
  block of a temporary, the free part of a small-block segment, a tensor freed while paused).
  While paused: new tensors of those sizes on two threads and two streams, a gloo and an NCCL
  barrier and all-reduce (a one-rank group), matmuls on the two streams whose cuBLAS
  workspaces torch made before the pause. None may land in paused memory, every kernel must
  run, and after ``resume("actor")`` the old tensors hold their contents and the new ones
  theirs; twice. Meanwhile ``torch.cuda.empty_cache()`` and a ``disable()`` block run. A third
  cycle is paused by another process
  (``memsaver pause --pid``, a control request).
* ``whole_process_unguarded``: the same first steps with the package's pause guard replaced by
  one that does nothing; the check passes if the process fails (illegal address) or a new
  tensor lands in paused memory, showing that the scenario above would catch the fault.
* ``whole_process_graph``: in the same mode, a CUDA graph with a matmul captured (the capture's
  allocations start the pinning of their backups in the background, which must not invalidate
  it) replays correctly after each of three pauses, with matmuls while paused.
* ``regions`` (preload) and ``regions_inprocess`` (no preload, torch's pluggable allocator):
  a region's tag paused with a block of it cached; untagged tensors meanwhile come from resident
  memory; entering the region is refused (``TagPausedError``); a pause of a tag whose region is
  open on another thread is refused (``PauseRefusedError``) with nothing paused.
* ``no_package``: a whole-process trainer that runs torch under the preload without importing
  memsaver, serving control requests: a pause asked by another process is refused, naming the
  cause, and the process keeps working.

Exits non-zero on any failure. Usage: python3 tests/gpu/paused_alloc.py [scenario ...]
"""
import json
import os
import subprocess
import sys
import threading

MIB = 1 << 20


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def paused_ranges(memsaver, tag):
    return [(a.ptr, a.ptr + a.size) for a in memsaver.allocations(tag) if a.state != "resident"]


def check_outside(memsaver, tag, tensors, what):
    ranges = paused_ranges(memsaver, tag)
    check(ranges, f"{tag} has nothing paused")
    for name, t in tensors.items():
        p = t.data_ptr()
        inside = [r for r in ranges if r[0] <= p < r[1]]
        check(not inside, f"{what}: {name} at {p:#x} lies in paused memory {inside}")


def work_while_paused(torch, dist, tag, memsaver):
    """New tensors of the cached sizes, on two threads and two streams, collectives and
    matmuls (whose cuBLAS workspaces torch made before the pause); returns the tensors. Each
    tensor is checked to lie outside paused memory before a kernel touches it, and each step is
    synchronised, so a failure names it."""
    new = {}

    def made(name, t, value):
        check_outside(memsaver, tag, {name: t}, "while paused")
        t.fill_(value)
        torch.cuda.synchronize()
        new[name] = t
        print("while paused:", name, "ok", flush=True)

    made("big", torch.empty(256 * MIB, dtype=torch.uint8, device="cuda"), 5)
    made("small", torch.empty(1000, device="cuda"), 7.0)
    made("same_as_freed", torch.empty(64 * MIB, dtype=torch.uint8, device="cuda"), 9)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.empty(3 * MIB, device="cuda")
    made("other_stream", t, 2.0)
    out = {}

    def other_thread():
        torch.cuda.set_device(0)
        out["t"] = torch.empty(2 * MIB, device="cuda")

    th = threading.Thread(target=other_thread)
    th.start()
    th.join()
    made("other_thread", out["t"], 4.0)
    for name, backend_group in zip(("gloo", "nccl"), dist["groups"], strict=True):
        dist["mod"].barrier(group=backend_group)
        torch.cuda.synchronize()
        print("while paused:", name, "barrier ok", flush=True)
    r = torch.empty(1024, device="cuda")
    made("reduced", r, 1.0)
    dist["mod"].all_reduce(r, group=dist["groups"][1])
    torch.cuda.synchronize()
    check(float(r.sum()) == 1024.0, "all_reduce while paused")
    a = torch.empty(256, 256, device="cuda")
    made("matmul_in", a, 1.0)
    for name, stream in (("matmul", torch.cuda.current_stream()), ("matmul_other_stream", side)):
        with torch.cuda.stream(stream):
            m = a @ a
        stream.synchronize()
        check(float(m[0, 0]) == 256.0, f"{name} while paused")
        new[name] = m
        print("while paused:", name, "ok", flush=True)
    return new


def scenario_whole_process(unguarded=False):
    import memsaver
    import torch
    import torch.distributed as dist
    from memsaver import _memsaver

    if unguarded:
        _memsaver.set_pause_guard(lambda event, tags: None)
    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    groups = [dist.new_group(backend="gloo"), dist.new_group(backend="nccl")]
    env = {"mod": dist, "groups": groups}
    dist.barrier()

    x = torch.full((256 * MIB,), 3, dtype=torch.uint8, device="cuda")
    y = x * 2  # a temporary: its 256 MiB block stays cached, free, in the process tag's memory
    del y
    keep = torch.full((1000,), 1.0, device="cuda")
    tmp = torch.ones(1000, device="cuda")  # the free part of a small-block segment
    del tmp
    doomed = torch.zeros(64 * MIB, dtype=torch.uint8, device="cuda")  # freed while paused
    w = torch.ones(256, 256, device="cuda")
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            w @ w  # torch makes a cuBLAS workspace per stream, in the process tag's memory
    torch.cuda.synchronize()
    memsaver.serve_control()

    cycles = []
    for cycle in range(3):
        if cycle < 2:
            memsaver.pause("actor")
        else:
            r = subprocess.run(
                [sys.executable, "-m", "memsaver", "pause", "--pid", str(os.getpid()), "actor"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            check(r.returncode == 0, f"memsaver pause --pid: {r.stdout}{r.stderr}")
        check(memsaver.stats().tags["actor"].paused, "actor not paused")
        if cycle == 0:
            del doomed  # its block goes back to torch's cache, inside paused memory
        new = work_while_paused(torch, env, "actor", memsaver)
        if not unguarded:
            # Emptying torch's cache while paused (verl does, right after a pause), and a
            # disable() block, whose pool is released at its end: torch fails an internal
            # assert if a cache is emptied while the guard's routing is active.
            torch.cuda.empty_cache()
            with memsaver.disable():
                d = torch.full((64 * MIB,), 7, dtype=torch.uint8, device="cuda")
                check(int(d.sum()) == 7 * 64 * MIB, "a tensor of a disable() block while paused")
                del d
            new["after_empty_cache"] = torch.ones(256, 256, device="cuda") @ torch.ones(
                256, 256, device="cuda"
            )
            check_outside(memsaver, "actor", {"after_empty_cache": new["after_empty_cache"]},
                          "after empty_cache while paused")
            print("while paused: empty_cache and disable() ok", flush=True)
        torch.cuda.synchronize()
        memsaver.resume("actor")
        check(int(x.sum()) == 3 * 256 * MIB, f"cycle {cycle}: x lost its contents")
        check(float(keep.sum()) == 1000.0, f"cycle {cycle}: keep lost its contents")
        for name, t in new.items():
            check(torch.isfinite(t.float()).all().item(), f"cycle {cycle}: {name}")
        check(int(new["big"].sum()) == 5 * 256 * MIB, f"cycle {cycle}: big")
        cycles.append(cycle)
        if unguarded:
            break
    dist.destroy_process_group()
    print(json.dumps({"cycles": len(cycles)}))


def scenario_whole_process_unguarded():
    scenario_whole_process(unguarded=True)


def scenario_whole_process_graph():
    """A CUDA graph with a matmul, captured in whole-process mode with cpu backup (whose
    allocations during the capture start the pinning of their backups in the background),
    replays correctly after each of three pauses and resumes, with matmuls while paused."""
    import memsaver
    import torch

    torch.cuda.set_device(0)
    a = torch.randn(512, 512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up, as torch's documentation asks before a capture
            out = a @ a
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = a @ a
    g.replay()
    torch.cuda.synchronize()
    expected = out.clone()
    for cycle in range(3):
        memsaver.pause("actor")
        x = torch.ones(256, 256, device="cuda")
        check(float((x @ x)[0, 0]) == 256.0, f"cycle {cycle}: matmul while paused")
        memsaver.resume("actor")
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        check(torch.equal(out, expected), f"cycle {cycle}: graph replay after resume")
    print(json.dumps({"cycles": 3}))


def scenario_regions():
    import memsaver
    import torch

    torch.cuda.set_device(0)
    with memsaver.region("kv", backup="cpu"):
        kv = torch.full((64 * MIB,), 2, dtype=torch.uint8, device="cuda")
        tmp = kv * 2  # cached, free, in the kv pool
        del tmp
    torch.cuda.synchronize()
    memsaver.pause("kv")
    untagged = {
        "a": torch.full((64 * MIB,), 1, dtype=torch.uint8, device="cuda"),
        "b": torch.ones(1000, device="cuda"),
    }
    check_outside(memsaver, "kv", untagged, "untagged while kv paused")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = untagged["b"] * 3
    g.replay()
    torch.cuda.synchronize()
    check(float(captured.sum()) == 3000.0, "graph captured while kv paused")
    try:
        with memsaver.region("kv", backup="cpu"):
            torch.ones(1000, device="cuda")
        raise AssertionError("a region of a paused tag was entered")
    except memsaver.TagPausedError:
        pass
    memsaver.resume("kv")
    check(int(kv.sum()) == 2 * 64 * MIB, "kv lost its contents")

    with memsaver.region("kv2", backup="cpu"):
        kv2 = torch.ones(1 << 20, device="cuda")
    entered, leave = threading.Event(), threading.Event()

    def hold_region():
        torch.cuda.set_device(0)
        with memsaver.region("kv2", backup="cpu"):
            entered.set()
            leave.wait(60)

    th = threading.Thread(target=hold_region, name="rollout-worker")
    th.start()
    entered.wait(60)
    try:
        memsaver.pause("kv", "kv2")
        raise AssertionError("a pause of a tag with an open region went through")
    except memsaver.PauseRefusedError as e:
        check("kv2" in str(e) and "rollout-worker" in str(e), f"refusal message: {e}")
    check(not memsaver.stats().tags["kv"].paused, "a refused pause paused kv")
    leave.set()
    th.join()
    memsaver.pause("kv", "kv2")
    memsaver.resume("kv", "kv2")
    check(float(kv2.sum()) == float(1 << 20), "kv2 lost its contents")
    print(json.dumps({"mode": memsaver.hook_mode()}))


def scenario_regions_inprocess():
    scenario_regions()


NO_PACKAGE_TRAINER = r"""
import sys, time, torch
x = torch.full((64 << 20,), 3, dtype=torch.uint8, device="cuda")
y = x * 2
del y
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
z = torch.ones(1 << 20, device="cuda")
print("alive", int(x.sum()) == 3 * (64 << 20), float(z.sum()) == float(1 << 20), flush=True)
"""


def scenario_no_package():
    env = dict(os.environ, MEMSAVER_CONTROL="1")
    p = subprocess.Popen(
        [sys.executable, "-c", NO_PACKAGE_TRAINER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        check(p.stdout.readline().strip() == "ready", "the trainer did not start")
        r = subprocess.run(
            [sys.executable, "-m", "memsaver", "pause", "--pid", str(p.pid), "actor"],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
        )
        out = r.stdout + r.stderr
        check(r.returncode != 0, f"the pause went through: {out}")
        check("libtorch_cuda.so" in out and "import memsaver" in out, f"refusal: {out}")
        p.stdin.write("go\n")
        p.stdin.flush()
        line = p.stdout.readline().strip()
        check(line == "alive True True", f"trainer after the refused pause: {line!r}")
        print(json.dumps({"refusal": [line for line in out.splitlines() if "refused" in line][:1]}))
    finally:
        p.kill()
        p.wait()


SCENARIOS = {
    "whole_process": {"MEMSAVER_PROCESS_TAG": "actor", "MEMSAVER_PROCESS_BACKUP": "cpu"},
    "whole_process_unguarded": {"MEMSAVER_PROCESS_TAG": "actor", "MEMSAVER_PROCESS_BACKUP": "cpu"},
    "whole_process_graph": {"MEMSAVER_PROCESS_TAG": "actor", "MEMSAVER_PROCESS_BACKUP": "cpu"},
    "regions": {},
    "regions_inprocess": None,
    "no_package": {"MEMSAVER_PROCESS_TAG": "actor", "MEMSAVER_PROCESS_BACKUP": "cpu"},
}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        globals()["scenario_" + sys.argv[2]]()
        return 0
    import memsaver

    preload = memsaver.preload_path()
    failed = []
    for name in sys.argv[1:] or list(SCENARIOS):
        extra = SCENARIOS[name]
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MEMSAVER_PROCESS_TAG")}
        if extra is not None:
            env.update(extra, LD_PRELOAD=preload)
        r = subprocess.run(
            [sys.executable, __file__, "--child", name], env=env, capture_output=True, text=True, timeout=300
        )
        lines = [line for line in (r.stdout + r.stderr).strip().splitlines() if "could not unpin" not in line]
        if name == "whole_process_unguarded":
            # Without the guard the process must fail (or report a tensor in paused memory).
            ok = r.returncode != 0 and any(
                "illegaladdress" in line.lower() or "paused memory" in line for line in lines
            )
        else:
            ok = r.returncode == 0
        print(("PASS " if ok else "FAIL ") + name)
        for line in lines[-4 if ok else -40 :]:
            print("    " + line)
        if not ok:
            failed.append(name)
    print("failed: " + (", ".join(failed) or "none"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
