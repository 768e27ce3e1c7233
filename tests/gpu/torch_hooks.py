#!/usr/bin/env python3
"""GPU check of memsaver under PyTorch, in both hook modes (issue 3).

Each scenario runs in its own process, once with LD_PRELOAD of libmemsaver.so ("preload") and
once without it ("inprocess": torch's CUDAPluggableAllocator in one MemPool per tag):

* tensors: cpu-backed weights come back bit-exact at the same data_ptr(); the discard kv_cache
  is usable after resume; an untagged tensor is untouched; pause frees at least 99% of the
  tagged bytes according to cudaMemGetInfo.
* graph: a CUDA graph captured with memsaver.cuda_graph replays correctly after its memory
  was paused and resumed.
* compat: torch_memory_saver's README usage through memsaver.compat.

Exits non-zero on any failure. Usage: python3 tests/gpu/torch_hooks.py
"""
import json
import os
import subprocess
import sys
import time

GIB = 1 << 30


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def scenario_tensors():
    import memsaver
    import torch

    torch.cuda.init()
    untagged = torch.arange(64 << 20, device="cuda", dtype=torch.int32)
    with memsaver.region("weights", backup="cpu"):
        weights = [torch.randn(128 << 20, device="cuda") for _ in range(4)]  # 4 x 512 MiB
    with memsaver.region("kv_cache"):
        kv = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    reference = [w.cpu() for w in weights]
    ptrs = [w.data_ptr() for w in weights] + [kv.data_ptr()]
    torch.cuda.synchronize()
    tagged = sum(t.reserved_bytes for t in memsaver.stats().tags.values())
    check(tagged >= 4 * GIB, f"tagged bytes {tagged}")

    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    memsaver.pause("weights", "kv_cache")
    pause_ms = (time.perf_counter() - t0) * 1e3
    free1 = torch.cuda.mem_get_info()[0]
    freed = free1 - free0
    check(freed >= 0.99 * tagged, f"pause freed {freed} of {tagged} tagged bytes")
    s = memsaver.stats()
    check(s.tags["weights"].resident_bytes == 0 and s.tags["kv_cache"].resident_bytes == 0, str(s))
    # Untagged memory is untouched and usable while the tags are paused.
    check(int(untagged[-1]) == (64 << 20) - 1, "untagged tensor changed")
    check(int((untagged * 2).sum().item()) == (64 << 20) * ((64 << 20) - 1), "untagged compute")

    t0 = time.perf_counter()
    memsaver.resume("weights", "kv_cache")
    resume_ms = (time.perf_counter() - t0) * 1e3
    check([w.data_ptr() for w in weights] + [kv.data_ptr()] == ptrs, "data_ptr changed")
    for w, r in zip(weights, reference, strict=True):
        check(torch.equal(w.cpu(), r), "weights differ after resume")
    kv.fill_(7)
    check(int(kv[-1].item()) == 7, "kv_cache unusable after resume")
    # A second cycle, and pause/resume of everything.
    memsaver.pause()
    memsaver.resume()
    for w, r in zip(weights, reference, strict=True):
        check(torch.equal(w.cpu(), r), "weights differ after second cycle")
    return {"tagged_bytes": tagged, "freed_bytes": freed, "freed_pct": 100.0 * freed / tagged,
            "pause_ms": pause_ms, "resume_ms": resume_ms}


def scenario_graph():
    import memsaver
    import torch

    torch.cuda.init()
    static_in = torch.randn(16 << 20, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture, as torch requires
        for _ in range(2):
            _ = static_in * 2 + 1
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with memsaver.cuda_graph(g, tag="cuda_graph"):
        static_out = static_in * 2 + 1
    g.replay()
    torch.cuda.synchronize()
    check(torch.allclose(static_out, static_in * 2 + 1), "graph replay before pause")
    graph_bytes = memsaver.stats().tags["cuda_graph"].reserved_bytes
    check(graph_bytes > 0, "the graph's memory was not tagged")
    free0 = torch.cuda.mem_get_info()[0]
    memsaver.pause("cuda_graph")
    freed = torch.cuda.mem_get_info()[0] - free0
    check(freed >= 0.99 * graph_bytes, f"graph pause freed {freed} of {graph_bytes}")
    memsaver.resume("cuda_graph")
    static_in.copy_(torch.randn_like(static_in))
    g.replay()
    torch.cuda.synchronize()
    check(torch.allclose(static_out, static_in * 2 + 1), "graph replay after resume")
    return {"graph_bytes": graph_bytes, "freed_bytes": freed}


def scenario_compat():
    import torch
    from memsaver.compat import torch_memory_saver

    torch.cuda.init()
    # torch_memory_saver's README usage.
    with torch_memory_saver.region():
        pauseable_tensor = torch.full((1_000_000_000,), 100, dtype=torch.uint8, device="cuda")
    normal_tensor = torch.full((1_000_000_000,), 100, dtype=torch.uint8, device="cuda")
    free0 = torch.cuda.mem_get_info()[0]
    torch_memory_saver.pause()
    freed = torch.cuda.mem_get_info()[0] - free0
    check(freed >= 0.99 * 1_000_000_000, f"compat pause freed {freed}")
    torch_memory_saver.resume()
    pauseable_tensor.fill_(1)
    check(int(normal_tensor[0].item()) == 100, "normal tensor changed")
    # Tags and CPU backup.
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        w = torch.full((256 << 20,), 3, dtype=torch.uint8, device="cuda")
    with torch_memory_saver.region(tag="kv_cache"):
        _kv = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    torch_memory_saver.pause("kv_cache")
    torch_memory_saver.pause("weights")
    torch_memory_saver.resume("weights")
    torch_memory_saver.resume("kv_cache")
    check(int(w.sum().item()) == 3 * (256 << 20), "compat cpu backup lost data")
    # A CUDA graph captured through the compat API, replayed after pause/resume of its tag.
    static_in = torch.ones(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch_memory_saver.cuda_graph(g, tag="graph"):
        static_out = static_in * 2
    g.replay()
    torch.cuda.synchronize()
    import memsaver
    check(memsaver.stats().tags["graph"].reserved_bytes > 0, "compat graph pool not tagged")
    torch_memory_saver.pause("graph")
    torch_memory_saver.resume("graph")
    static_in.fill_(3)
    g.replay()
    torch.cuda.synchronize()
    check(bool(torch.all(static_out == 6).item()), "compat graph replay wrong after resume")
    return {"freed_bytes": freed}


SCENARIOS = {"tensors": scenario_tensors, "graph": scenario_graph, "compat": scenario_compat}


def run_child(name):
    out = SCENARIOS[name]()
    import memsaver
    out["mode"] = memsaver.hook_mode()
    print("RESULT " + json.dumps(out), flush=True)


def main():
    import memsaver

    failures = []
    results = []
    for mode in ("preload", "inprocess"):
        env = dict(os.environ, NCCL_NVLS_ENABLE="0")
        env.pop("LD_PRELOAD", None)
        if mode == "preload":
            env["LD_PRELOAD"] = memsaver.preload_path()
        for name in SCENARIOS:
            p = subprocess.run([sys.executable, __file__, "--child", name], env=env,
                               capture_output=True, text=True, timeout=300)
            line = next((s for s in p.stdout.splitlines() if s.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                failures.append(f"{mode}/{name}")
                print(f"FAIL {mode}/{name} (exit {p.returncode})\n{p.stdout}\n{p.stderr}")
                continue
            r = json.loads(line[len("RESULT "):])
            if r["mode"] != mode:
                failures.append(f"{mode}/{name}: ran in mode {r['mode']}")
            results.append((mode, name, r))
            print(f"ok   {mode:<9} {name:<8} {r}")
    if failures:
        print("FAILED: " + ", ".join(failures))
        sys.exit(1)
    print("torch_hooks: PASS")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        run_child(sys.argv[2])
    else:
        main()
