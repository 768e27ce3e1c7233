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
* disable: a tensor made in ``memsaver.disable()`` inside a region is not the region's: pausing
  the tag frees the tag's memory (>= 99%) and leaves that tensor's contents; the region's pool
  is back after the block.
* disable_process (preload only, whole-process mode: ``MEMSAVER_PROCESS_TAG=proc``): torch's
  default pool holds the process tag's memory, so ``disable()`` allocates from a pool of its
  own: its tensor keeps its contents while ``proc`` is paused.

(The fake-driver tests check the same logic against a torch stand-in:
tests/python/test_api.py::test_disable_under_torch_suspends_the_region_pool and
tests/python/test_processes.py::test_disable_in_whole_process_mode_uses_a_pool_of_its_own.)

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


def scenario_disable():
    import memsaver
    import torch

    torch.cuda.init()
    with memsaver.region("disabled_in"):
        tagged = torch.full((256 << 20,), 1, dtype=torch.uint8, device="cuda")
        with memsaver.disable():
            untagged = torch.full((256 << 20,), 5, dtype=torch.uint8, device="cuda")
        again = torch.full((64 << 20,), 1, dtype=torch.uint8, device="cuda")  # the region's pool
    torch.cuda.synchronize()
    t = memsaver.stats().tags["disabled_in"]
    check(t.resident_bytes >= 320 << 20, f"the region's tensors are not all tagged: {t}")
    free0 = torch.cuda.mem_get_info()[0]
    memsaver.pause("disabled_in")
    freed = torch.cuda.mem_get_info()[0] - free0
    check(freed >= 0.99 * t.resident_bytes, f"pause freed {freed} of {t.resident_bytes}")
    # Read back without allocating on the device (the paused tag's pool must not be touched).
    check(bool((untagged[-4096:].cpu() == 5).all()), "disable()'s tensor lost its contents")
    memsaver.resume("disabled_in")
    tagged.fill_(2)
    again.fill_(2)
    check(int(tagged[-1].item()) == 2 and int(again[-1].item()) == 2, "tag unusable after resume")
    check(bool((untagged[-4096:].cpu() == 5).all()), "disable()'s tensor changed")
    return {"tagged_bytes": t.resident_bytes, "freed_bytes": freed}


def scenario_disable_process():
    import memsaver
    import torch

    torch.cuda.init()
    process = torch.full((256 << 20,), 1, dtype=torch.uint8, device="cuda")  # tag "proc"
    with memsaver.disable():
        own = torch.full((256 << 20,), 2, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t = memsaver.stats().tags["proc"]
    check(t.resident_bytes >= 256 << 20, f"the process tag holds {t}")
    free0 = torch.cuda.mem_get_info()[0]
    memsaver.pause("proc")
    freed = torch.cuda.mem_get_info()[0] - free0
    check(freed >= 0.99 * t.resident_bytes, f"pause freed {freed} of {t.resident_bytes}")
    check(bool((own[-4096:].cpu() == 2).all()), "disable()'s tensor was paused with the process tag")
    memsaver.resume("proc")
    process.fill_(3)
    check(int(process[-1].item()) == 3, "the process tag unusable after resume")
    return {"process_bytes": t.resident_bytes, "freed_bytes": freed}


SCENARIOS = {"tensors": scenario_tensors, "graph": scenario_graph, "compat": scenario_compat,
             "disable": scenario_disable, "disable_process": scenario_disable_process}
# Scenarios that run in one mode only, and the environment they add.
ONLY = {"disable_process": ("preload", {"MEMSAVER_PROCESS_TAG": "proc"})}


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
            only_mode, extra = ONLY.get(name, (mode, {}))
            if only_mode != mode:
                continue
            p = subprocess.run([sys.executable, __file__, "--child", name], env={**env, **extra},
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
