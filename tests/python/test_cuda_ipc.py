"""CUDA IPC handles of memsaver memory seen from Python: the owner's ``Stats.shared_exports``
and a receiver's ``Stats.shared_imports`` (the multi-process semantics are tested with real
processes in tests/scenarios/tests/cuda_ipc.rs)."""

from __future__ import annotations

import ctypes
import json
import os

import memsaver
from helpers import MiB, pattern, run_python, write

RECEIVER = r"""
import ctypes, json, sys
import memsaver
memsaver.hook_mode()
lib = ctypes.CDLL(memsaver.preload_path())
class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]
lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), Handle, ctypes.c_uint]
lib.memsaver_last_error.restype = ctypes.c_char_p
h = Handle()
ctypes.memmove(h.reserved, bytes.fromhex(sys.argv[1]), 64)
p = ctypes.c_void_p()
rc = lib.cudaIpcOpenMemHandle(ctypes.byref(p), h, 1)
if rc != 0:
    print(json.dumps({"rc": rc, "error": lib.memsaver_last_error().decode()}))
    sys.exit(0)
data = ctypes.string_at(p.value, int(sys.argv[2])).hex()
imports = [i.__dict__ for i in memsaver.stats().shared_imports]
print(json.dumps({"rc": rc, "data": data, "imports": imports}))
"""


def handle_of(hooks: object, ptr: int) -> str:
    lib = hooks.lib  # type: ignore[attr-defined]
    buf = (ctypes.c_ubyte * 64)()
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaIpcGetMemHandle.restype = ctypes.c_int
    lib.memsaver_last_error.restype = ctypes.c_char_p
    assert lib.cudaIpcGetMemHandle(buf, ptr) == 0, lib.memsaver_last_error()
    return bytes(buf).hex()


def test_stats_show_exports_and_imports(hooks, tag):
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(2 * MiB)
    data = pattern(4096)
    write(p, data)
    h = handle_of(hooks, p)
    out = run_python(RECEIVER, dict(os.environ), h, str(len(data)))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["rc"] == 0, got
    assert bytes.fromhex(got["data"]) == data
    assert got["imports"] == [
        {"owner_pid": os.getpid(), "bytes": 2 * MiB, "paused": False, "opens": 1}
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
    h = bytearray.fromhex(handle_of(hooks, p))
    h[44] ^= 1  # the key
    out = run_python(RECEIVER, dict(os.environ), h.hex(), "16")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["rc"] != 0 and "refused" in got["error"], got
    assert memsaver.stats().shared_exports[tag].importers == 0
    assert hooks.free(p) == 0
