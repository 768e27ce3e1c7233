"""CUDA IPC handles of memsaver memory seen from Python: the owner's ``Stats.shared_exports``
and a receiver's ``Stats.shared_imports`` (the multi-process semantics are tested with real
processes in tests/scenarios/tests/cuda_ipc.rs), and the error torch's sharing of memsaver
memory raises in in-process mode, where no preload interposes ``cudaIpcGetMemHandle``."""

from __future__ import annotations

import ctypes
import json
import os
import sys

import memsaver
import pytest
from helpers import IPC_OPEN, MiB, pattern, run_python, write

RECEIVER = IPC_OPEN + r"""
import json, sys
rc, p, error = ipc_open(sys.argv[1])
if rc != 0:
    print(json.dumps({"rc": rc, "error": error}))
    sys.exit(0)
data = ctypes.string_at(p, int(sys.argv[2])).hex()
imports = [i.__dict__ for i in memsaver.stats().shared_imports]
print(json.dumps({"rc": rc, "data": data, "imports": imports}))
"""


def test_stats_show_exports_and_imports(hooks, tag):
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(2 * MiB)
    data = pattern(4096)
    write(p, data)
    h = hooks.ipc_handle(p)
    out = run_python(RECEIVER, dict(os.environ), h, str(len(data)))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["rc"] == 0, got
    assert bytes.fromhex(got["data"]) == data
    assert got["imports"] == [
        {
            "owner_pid": os.getpid(),
            "bytes": 2 * MiB,
            "paused": False,
            "opens": 1,
            "via": "cuda_ipc",
        }
    ]
    e = memsaver.stats().shared_exports[tag]
    assert (e.handles, e.bytes, e.importers) == (1, 2 * MiB, 1)
    # The receiver exited holding the import: the pause counts it as released and forgets it.
    memsaver.pause(tag)
    assert memsaver.stats().shared_exports[tag].importers == 0
    memsaver.resume(tag)
    assert hooks.free(p) == 0


def test_a_forged_handle_is_refused(hooks, tag):
    with memsaver.region(tag):
        p = hooks.malloc_ok(2 * MiB)
    h = bytearray.fromhex(hooks.ipc_handle(p))
    h[44] ^= 1  # the key
    out = run_python(RECEIVER, dict(os.environ), h.hex(), "16")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["rc"] != 0 and "refused" in got["error"], got
    assert memsaver.stats().shared_exports[tag].importers == 0
    assert hooks.free(p) == 0


def test_in_process_sharing_of_memsaver_memory_says_to_use_the_preload(hooks, tag, tag2, monkeypatch):
    """In in-process mode torch's ``_share_cuda_`` (what torch.multiprocessing and reduce_tensor
    call) would ask libcudart for a handle of memsaver memory and fail with
    cudaErrorInvalidValue: the guard memsaver installs with its pluggable allocator raises a
    MemsaverError saying what to do, and passes every other storage to torch's method. Under a
    torch stand-in (tests/python/fake_torch.py)."""
    from fake_torch import FakeTorch
    from memsaver import _torch

    assert memsaver.hook_mode() == "inprocess"
    torch = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(_torch, "_pools", {})
    monkeypatch.setattr(_torch, "_allocator", None)
    original = torch.UntypedStorage._share_cuda_
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(2 * MiB)
    guarded = torch.UntypedStorage._share_cuda_
    assert guarded is not original and guarded._memsaver_original is original

    # A tensor in the middle of the allocation, shared as reduce_tensor does (its typed storage).
    inside = torch.TypedStorage(torch.UntypedStorage(p + 4096))
    with pytest.raises(memsaver.MemsaverError) as e:
        inside._share_cuda_()
    msg = str(e.value)
    assert isinstance(e.value, RuntimeError)
    assert f"memsaver memory of tag '{tag}'" in msg and "in-process mode" in msg, msg
    assert "torch.multiprocessing" in msg and "cudaIpcGetMemHandle" in msg, msg
    # The fix, in each form a launcher can take.
    assert f"LD_PRELOAD={memsaver.preload_path()}" in msg and "memsaver preload-path" in msg, msg
    assert 'eval "$(python3 -m memsaver env)"' in msg and "memsaver.subprocess_env()" in msg, msg
    memsaver.pause(tag)  # paused memory is still memsaver's
    with pytest.raises(memsaver.MemsaverError, match="in-process mode"):
        inside._share_cuda_()
    memsaver.resume(tag)
    assert not [c for c in torch.calls if c[0] == "share_cuda"], "torch's method never ran"

    # Host memory, an empty storage (no data pointer): torch's own method, with its answer.
    host = ctypes.create_string_buffer(64)
    other = torch.UntypedStorage(ctypes.addressof(host), 64)
    assert torch.TypedStorage(other)._share_cuda_() == (0, b"handle", 64, 0)
    assert torch.UntypedStorage(0)._share_cuda_() == (0, b"handle", 4096, 0)
    assert [c for c in torch.calls if c[0] == "share_cuda"] == [
        ("share_cuda", ctypes.addressof(host)), ("share_cuda", 0),
    ]

    # Installed once: another allocator (another pool kind, or here a fresh start) keeps it.
    monkeypatch.setattr(_torch, "_allocator", None)
    with memsaver.region(tag2):
        pass
    assert torch.UntypedStorage._share_cuda_ is guarded

    # Freed memory is memsaver's no more: its address goes to torch.
    assert hooks.free(p) == 0
    assert inside._share_cuda_() == (0, b"handle", 4096, 0)
    assert torch.calls[-1] == ("share_cuda", p + 4096)


PRELOADED_SHARE = r"""
import ctypes, json, sys
from fake_torch import FakeTorch
torch = sys.modules["torch"] = FakeTorch()
import memsaver

original = torch.UntypedStorage._share_cuda_
lib = ctypes.CDLL(None)   # the preloaded cudaMalloc
lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
p = ctypes.c_void_p()
with memsaver.region("shared"):
    rc = lib.cudaMalloc(ctypes.byref(p), 2 << 20)
print(json.dumps({
    "mode": memsaver.hook_mode(),
    "rc": rc,
    "pools": [c[2] for c in torch.calls if c[0] == "pool"],
    "unchanged": torch.UntypedStorage._share_cuda_ is original,
    "shared": list(torch.UntypedStorage(p.value)._share_cuda_()[:1]),
    "calls": [c for c in torch.calls if c[0] == "share_cuda"] == [("share_cuda", p.value)],
}))
"""


def test_no_guard_under_the_preload(child_env):
    """Under the preload the interposed cudaIpcGetMemHandle shares memsaver memory: torch's
    ``_share_cuda_`` is left alone, also with expandable segments, where tagged memory comes
    from the pluggable allocator as in in-process mode."""
    path = os.pathsep.join(p for p in (os.path.dirname(__file__), child_env.get("PYTHONPATH")) if p)
    env = dict(child_env, LD_PRELOAD=memsaver.preload_path(), MEMSAVER_HOOK_MODE="preload",
               PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", PYTHONPATH=path)
    r = run_python(PRELOADED_SHARE, env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "preload" and out["rc"] == 0
    assert out["pools"] == ["memsaver's pluggable allocator"], "the pluggable allocator was made"
    assert out["unchanged"] and out["shared"] == [0] and out["calls"], out
