"""The public parts of torch_memory_saver's tests that also reach into its internals, run
against memsaver (ONE GPU, under the opt-in alias, like tests/gpu/tms_suite.sh):

* ``examples/cpu_backup.py::run`` (pinned and mmap backups, ``get_cpu_backup``, retention,
  tags kept apart): unchanged, except its last helper, which pops the test's MemPool out of
  ``_impl._mem_pools`` and calls ``cudaHostGetFlags`` through tms's binary. It is replaced by
  the same check made through public interfaces: a retained pinned backup is freed (the CUDA
  runtime no longer knows the host pointer) when its allocation is freed, running or paused.
* ``examples/cpu_backup.py::run_backend_from_env`` with its two assertions on tms's C getters
  replaced by the effect they stand for (the backup is an mmap backup: not pinned).
* the VMM-granularity scenario of ``examples/cuda_vmm_granularity.py`` with memsaver's C ABI
  in place of the ``tms_pause``/``tms_resume`` symbols: unaligned cudaMalloc sizes in
  whole-process mode, a block freed while paused.

    TMS=<torch_memory_saver checkout>/test MEMSAVER_TORCH_MEMORY_SAVER=1 \\
        python3 tests/gpu/tms_public.py            # runs each case in a child, both modes

Exits non-zero on failure.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys

CASES = ("cpu_backup", "backend_from_env", "granularity")


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (found in the process's mappings)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("libcudart is not loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


def _is_pinned(addr: int) -> bool:
    rt = _cudart()
    flags = ctypes.c_uint()
    rc = rt.cudaHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(addr))
    if rc != 0:
        rt.cudaGetLastError()
    return rc == 0


def _released_on_free(device: int, paused: bool) -> None:
    """A retained pinned backup is freed with its allocation (memsaver's C ABI allocates, so
    the allocation really is freed, which a tag's long-lived torch pool would not do)."""
    import memsaver
    from memsaver import _memsaver

    tag = f"released_on_free_{device}_{int(paused)}"
    memsaver.set_retain_backups(True)
    try:
        ptr = _memsaver.malloc(4 << 20, device, tag, "cpu")
        memsaver.pause(tag)
        host = _memsaver.backup_pointer(ptr, 4 << 20)
        assert host and _is_pinned(host), "a paused cpu allocation has a pinned backup"
        if not paused:
            memsaver.resume(tag)
            assert _memsaver.backup_pointer(ptr, 4 << 20) == host, "retained across resume"
        _memsaver.free(ptr)
        gc.collect()
        assert not _is_pinned(host), "the backup was not freed with its allocation"
    finally:
        memsaver.set_retain_backups(False)


def _run(case: str, hook_mode: str) -> None:
    sys.path.insert(0, os.environ["TMS"])
    import torch
    from examples import cpu_backup  # torch_memory_saver's test code, not ours
    from torch_memory_saver import torch_memory_saver

    if case == "cpu_backup":
        cpu_backup._assert_cpu_backup_released_on_allocation_free = _released_on_free
        cpu_backup.run(hook_mode=hook_mode)
    elif case == "backend_from_env":
        torch_memory_saver.hook_mode = hook_mode
        with torch_memory_saver.region(enable_cpu_backup=True):
            t = torch.full((20_000_000,), 10, dtype=torch.uint8, device="cuda")
        torch_memory_saver.pause()
        backup = torch_memory_saver.get_cpu_backup(t, zero_copy=True)
        assert backup is not None and not _is_pinned(backup.data_ptr()), "mmap backup expected"
        del backup
        torch_memory_saver.resume()
        assert t[:3].tolist() == [10, 10, 10]
        assert torch_memory_saver.get_cpu_backup(t) is None
    elif case == "granularity":
        import memsaver

        rt = _cudart()
        rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        rt.cudaFree.argtypes = [ctypes.c_void_p]
        hooked = ctypes.CDLL(None)  # the preloaded cudaMalloc/cudaFree come first
        malloc, memcpy, free = hooked.cudaMalloc, rt.cudaMemcpy, hooked.cudaFree
        malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        free.argtypes = [ctypes.c_void_p]
        torch.cuda.init()

        def round_trip(p: ctypes.c_void_p, v: int) -> None:
            w, r = ctypes.c_ubyte(v), ctypes.c_ubyte()
            assert memcpy(p, ctypes.byref(w), 1, 1) == 0 and memcpy(ctypes.byref(r), p, 1, 2) == 0
            assert r.value == v

        a, b, c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        assert malloc(ctypes.byref(a), 6912) == 0 and a.value
        assert memsaver.stats().tags["default"].allocations >= 1, "whole-process mode tags it"
        round_trip(a, 0xA5)
        memsaver.pause()
        memsaver.resume()
        round_trip(a, 0x5A)
        assert free(a) == 0
        assert malloc(ctypes.byref(b), 6912) == 0 and malloc(ctypes.byref(c), 6912) == 0
        round_trip(c, 0xA5)
        memsaver.pause()
        assert free(b) == 0  # freed while paused
        memsaver.resume()
        round_trip(c, 0x5A)
        assert free(c) == 0
    print(f"PASS {case} [{hook_mode}]", flush=True)


def main() -> int:
    if len(sys.argv) == 3:
        _run(sys.argv[1], sys.argv[2])
        return 0
    import memsaver

    failed = 0
    runs = [("cpu_backup", "preload"), ("cpu_backup", "torch"), ("backend_from_env", "preload"),
            ("backend_from_env", "torch"), ("granularity", "preload")]
    for case, mode in runs:
        env = dict(os.environ, MEMSAVER_TORCH_MEMORY_SAVER="1")
        if mode == "preload":
            env["LD_PRELOAD"] = memsaver.preload_path()
            env["MEMSAVER_HOOK_MODE"] = "preload"
        if case == "backend_from_env":
            env["TMS_INIT_CPU_BACKUP_BACKEND"] = "mmap"
        if case == "granularity":
            env["TMS_INIT_ENABLE"] = "1"
        r = subprocess.run([sys.executable, __file__, case, mode], env=env, timeout=600)
        if r.returncode != 0:
            print(f"FAIL {case} [{mode}] (exit {r.returncode})", flush=True)
            failed += 1
    print("PASS tms_public" if not failed else f"FAIL tms_public ({failed} case(s))")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
