"""Helpers of the Python tests (fixtures are in conftest.py)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Callable

import memsaver

CUDA_SUCCESS = 0
# What the hooked cudaMalloc returns when it forwards a call (no region open, or inside
# disable()) and the process has no libcudart to forward it to: cudaErrorInitializationError,
# answered by libmemsaver.so itself (torch-shim/src/hooks.rs; tests/c_abi.rs pins the same
# code). The test process never loads libcudart (no torch): see `cudart_loaded`. A process that
# has one gets cudart's own answer (test_api.py::test_forwarded_calls_reach_libcudart).
CUDA_ERROR_INITIALIZATION = 3
MiB = 1 << 20


def cudart_loaded() -> bool:
    """Whether a libcudart is mapped into this process."""
    with open("/proc/self/maps") as f:
        return "libcudart" in f.read()


class Hooks:
    """libmemsaver.so's interposed cudaMalloc/cudaFree, called as torch would call them."""

    def __init__(self) -> None:
        memsaver.hook_mode()  # load the library the way the package does
        self.lib = ctypes.CDLL(memsaver.preload_path())
        self.lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        self.lib.cudaMalloc.restype = ctypes.c_int
        self.lib.cudaFree.argtypes = [ctypes.c_void_p]
        self.lib.cudaFree.restype = ctypes.c_int

    def malloc(self, size: int) -> tuple[int, int]:
        """(cudaError, pointer)."""
        p = ctypes.c_void_p()
        rc = self.lib.cudaMalloc(ctypes.byref(p), size)
        return rc, p.value or 0

    def malloc_ok(self, size: int) -> int:
        rc, p = self.malloc(size)
        assert rc == CUDA_SUCCESS and p, f"cudaMalloc failed with {rc}"
        return p

    def free(self, ptr: int) -> int:
        return self.lib.cudaFree(ptr)

    def ipc_handle(self, ptr: int) -> str:
        """The interposed cudaIpcGetMemHandle's handle of ``ptr`` (memsaver's own for memsaver
        memory), as hex: what torch would pickle and send."""
        buf = (ctypes.c_ubyte * 64)()
        self.lib.cudaIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cudaIpcGetMemHandle.restype = ctypes.c_int
        self.lib.memsaver_last_error.restype = ctypes.c_char_p
        assert self.lib.cudaIpcGetMemHandle(buf, ptr) == 0, self.lib.memsaver_last_error()
        return bytes(buf).hex()


# Python code for a child process: `ipc_open(hex)` opens a handle of `Hooks.ipc_handle` with the
# interposed cudaIpcOpenMemHandle, as torch's rebuild of a shared tensor does, and returns
# (cudaError, pointer, memsaver's last error).
IPC_OPEN = r"""
import ctypes
import memsaver
memsaver.hook_mode()
_lib = ctypes.CDLL(memsaver.preload_path())
class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]
_lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]
_lib.memsaver_last_error.restype = ctypes.c_char_p
def ipc_open(hex_handle):
    h = _Handle()
    ctypes.memmove(h.reserved, bytes.fromhex(hex_handle), 64)
    p = ctypes.c_void_p()
    rc = _lib.cudaIpcOpenMemHandle(ctypes.byref(p), h, 1)
    return rc, p.value, _lib.memsaver_last_error().decode()
"""


def write(ptr: int, data: bytes) -> None:
    ctypes.memmove(ptr, data, len(data))


def read(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


def pattern(n: int, seed: int = 7) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def run_python(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Runs `python -c code` (or `python args...` when code is empty) in a child process."""
    argv = [sys.executable, *(["-c", code] if code else []), *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def as_nobody(fn: Callable[[], int]) -> int:
    """Runs `fn` in a forked child as uid and gid 65534 (needs root); returns the child's exit
    status, `fn`'s result (1 if it raised, said on stderr)."""
    child = os.fork()
    if child == 0:  # pragma: no cover - in the child
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = fn()
        except BaseException as e:  # noqa: BLE001 - said, then the exit status
            print(f"in the child: {e!r}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
