"""``TorchMemorySaver``: torch_memory_saver's class, each method a memsaver call."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, Literal

import memsaver

from .. import _memsaver
from .utils import is_xpu

__all__ = ["TorchMemorySaver", "CpuBackupBackend"]

logger = logging.getLogger("memsaver.compat")

_TAG_DEFAULT = "default"
_HOOK_MODES = ("preload", "torch")
CpuBackupBackend = Literal["mmap", "pinned"]
_BACKENDS = ("pinned", "mmap")
#: torch_memory_saver's variables read when the API is first used.
_RETAIN_ENV = "TMS_RETAIN_CPU_BACKUP"
_BACKEND_ENV = "TMS_INIT_CPU_BACKUP_BACKEND"
_DISK_DIR_ENV = "TMS_DISK_BACKUP_DIR"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver``; use the ``torch_memory_saver`` instance."""

    def __init__(self) -> None:
        self._hook_mode: str | None = None
        self._memory_margin_bytes = 0
        self._initialized = False
        self._default_backend: str = "pinned"

    def _ensure_initialized(self) -> None:
        if self._initialized:
            return
        if self._hook_mode == "preload":
            memsaver.require_preload()
        memsaver._core.ensure_loaded()
        backend = os.environ.get(_BACKEND_ENV, "").strip() or "pinned"
        if backend not in _BACKENDS:
            raise ValueError(f"{_BACKEND_ENV}={backend!r}: expected one of {', '.join(_BACKENDS)}")
        self._default_backend = backend
        # torch_memory_saver releases host backups after resume unless told to keep them.
        memsaver.set_retain_backups(_env_flag(_RETAIN_ENV))
        disk_dir = os.environ.get(_DISK_DIR_ENV, "").strip()
        if disk_dir:
            memsaver.set_disk_dir(disk_dir)
        self._initialized = True

    def _policy(
        self, enable_cpu_backup: bool, enable_disk_backup: bool, backend: str | None
    ) -> Literal["discard", "cpu", "mmap", "disk"]:
        if enable_disk_backup:
            return "disk"
        if not enable_cpu_backup:
            return "discard"
        return "mmap" if (backend or self._default_backend) == "mmap" else "cpu"

    @staticmethod
    def _validate(
        enable_cpu_backup: bool, enable_disk_backup: bool, backend: str | None
    ) -> None:
        if enable_cpu_backup and enable_disk_backup:
            raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        if backend is None:
            return
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if is_xpu():
            raise ValueError("cpu_backup_backend is not supported on XPU")
        torch = sys.modules.get("torch")
        if backend == "mmap" and getattr(getattr(torch, "version", None), "hip", None):
            raise ValueError("cpu_backup_backend='mmap' is not supported on ROCm")
        if backend not in _BACKENDS:
            raise ValueError(
                f"cpu_backup_backend={backend!r}: expected one of {', '.join(_BACKENDS)}"
            )

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """Tensors allocated inside are pausable under ``tag``. With ``enable_cpu_backup`` their
        contents survive pause/resume in host memory (``cpu_backup_backend``: ``"pinned"``, the
        default, or ``"mmap"``); with ``enable_disk_backup``, in a file of the disk backup
        directory (``set_disk_backup_dir``). Regions nest; the innermost applies."""
        self._validate(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        self._ensure_initialized()
        policy = self._policy(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        with memsaver.region(tag, backup=policy):
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """Like ``torch.cuda.graph``, with the capture's memory pausable under ``tag``."""
        self._validate(enable_cpu_backup, False, cpu_backup_backend)
        self._ensure_initialized()
        with memsaver.cuda_graph(
            cuda_graph,
            tag=tag,
            backup=self._policy(enable_cpu_backup, False, cpu_backup_backend),
            pool=pool,
            stream=stream,
            capture_error_mode=capture_error_mode,
        ):
            yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations inside are not pausable, even inside a region or in whole-process mode
        (they come from a pool of their own, released when the block ends)."""
        self._ensure_initialized()
        with memsaver.disable():
            yield

    def pause(self, tag: str | None = None) -> None:
        """Pauses ``tag``, or every tensor tag when ``tag`` is None (torch_memory_saver knows
        no NCCL memory: pause ``"nccl"`` by name, or use ``memsaver.pause()``, for that)."""
        self._ensure_initialized()
        self._call(memsaver.pause, "pause", tag)

    def resume(self, tag: str | None = None) -> None:
        """Resumes ``tag``, or every tensor tag when ``tag`` is None."""
        self._ensure_initialized()
        self._call(memsaver.resume, "resume", tag)

    @staticmethod
    def _call(fn: Any, name: str, tag: str | None) -> None:
        if tag is None:
            tensor_tags = [t for t in memsaver.stats().tags if t != "nccl"]
            if tensor_tags:
                fn(*tensor_tags)
            return
        try:
            fn(tag)
        except memsaver.UnknownTagError as e:
            # torch_memory_saver treats a tag without allocations as nothing to do.
            logger.warning("torch_memory_saver.%s(%r) did nothing: %s", name, tag, e)

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> str:
        """``"preload"`` or ``"torch"`` (in-process pluggable allocator)."""
        if self._hook_mode is not None:
            return self._hook_mode
        return "preload" if memsaver.hook_mode() == "preload" else "torch"

    @hook_mode.setter
    def hook_mode(self, value: str) -> None:
        if value not in _HOOK_MODES:
            raise ValueError(f"hook_mode must be one of {_HOOK_MODES}, not {value!r}")
        self._hook_mode = value
        self._initialized = False

    @property
    def memory_margin_bytes(self) -> int:
        """Device memory resume leaves free: a resume that would go below it stops with
        ``ResumeOutOfMemoryError`` (what was resumed stays resumed)."""
        return self._memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        self._ensure_initialized()
        memsaver.set_memory_margin(int(value))
        self._memory_margin_bytes = int(value)

    @property
    def retain_cpu_backup(self) -> bool:
        """Keep host backups after resume (the next pause then copies into them without
        allocating). Off by default here, as in torch_memory_saver."""
        self._ensure_initialized()
        return memsaver.retain_backups()

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized()
        memsaver.set_retain_backups(bool(value))

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        """The host backup of tensor ``x`` as a CPU tensor of the same dtype and shape, or None
        when ``x``'s memory has no host backup now (never paused, released after resume, or
        not backed up to host memory). ``zero_copy=True`` returns a view of the backup itself,
        valid only until the backup is released."""
        self._ensure_initialized()
        if not getattr(x, "is_cuda", False):
            raise ValueError(f"get_cpu_backup needs a CUDA tensor, got {type(x).__name__}")
        if not x.is_contiguous():
            raise ValueError("get_cpu_backup needs a contiguous tensor")
        torch = sys.modules["torch"]
        nbytes = x.numel() * x.element_size()
        addr = _memsaver.backup_pointer(x.data_ptr(), nbytes) if nbytes else 0
        if not addr:
            return None
        host = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)
        ans = host.view(x.dtype).view(x.shape)
        return ans if zero_copy else ans.clone()

    def set_disk_backup_dir(self, path: str) -> None:
        """Directory for disk backups (created mode 0700 if needed; an existing one must be
        this user's and not writable by others); it should be a real disk, not tmpfs."""
        self._ensure_initialized()
        memsaver.set_disk_dir(path)
