"""A drop-in for torch_memory_saver's Python API (0.0.10), backed by memsaver.

Switch with one import::

    # from torch_memory_saver import torch_memory_saver
    from memsaver.compat import torch_memory_saver

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = ...
    torch_memory_saver.pause("weights")
    torch_memory_saver.resume("weights")

Differences, all on the side of keeping programs running:

* ``hook_mode``: left unset, memsaver uses whatever the process has (the preloaded library,
  else the in-process pluggable allocator, which torch_memory_saver calls "torch"). Set to
  ``"preload"``, a process started without the preload raises ``MemsaverError`` saying how to
  start it; ``"torch"`` maps to memsaver's in-process mode.
* ``cuda_graph`` works in both hook modes (torch_memory_saver: preload only).
* ``disable()`` works outside regions too.
* ``pause(tag)``/``resume(tag)`` of a tag that never had a region do nothing, as in
  torch_memory_saver, but log a warning with the known tags (``memsaver.pause`` raises).
* ``memory_margin_bytes`` is accepted and unused: memsaver reports out-of-memory on resume as
  ``ResumeOutOfMemoryError`` (what was resumed stays resumed) instead of keeping a margin.
* Disk backup and reading CPU backups (``enable_disk_backup``, ``set_disk_backup_dir``,
  ``get_cpu_backup``) are not available and raise ``NotImplementedError``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Literal

import memsaver

from ._launch import configure_subprocess

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess"]

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"
_HOOK_MODES = ("preload", "torch")


def _policy(enable_cpu_backup: bool) -> Literal["discard", "cpu"]:
    return "cpu" if enable_cpu_backup else "discard"


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver``; use the ``torch_memory_saver`` instance."""

    def __init__(self) -> None:
        self._hook_mode: str | None = None
        self._memory_margin_bytes = 0
        self._checked = False

    def _ensure_initialized(self) -> None:
        if self._checked:
            return
        if self._hook_mode == "preload":
            memsaver.require_preload()
        self._checked = True

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        """Tensors allocated inside are pausable under ``tag``; with ``enable_cpu_backup``
        their contents survive pause/resume. ``cpu_backup_backend`` is accepted; memsaver
        always backs up to pinned host memory."""
        if enable_disk_backup:
            raise NotImplementedError("memsaver has no disk backup; use enable_cpu_backup=True")
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        self._ensure_initialized()
        with memsaver.region(tag, backup=_policy(enable_cpu_backup)):
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
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        """Like ``torch.cuda.graph``, with the capture's memory pausable under ``tag``."""
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        self._ensure_initialized()
        with memsaver.cuda_graph(
            cuda_graph,
            tag=tag,
            backup=_policy(enable_cpu_backup),
            pool=pool,
            stream=stream,
            capture_error_mode=capture_error_mode,
        ):
            yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations inside are not pausable, even inside a region."""
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
        if not tag:
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
        self._checked = False

    @property
    def memory_margin_bytes(self) -> int:
        """Accepted for compatibility and unused (see the module documentation)."""
        return self._memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        self._memory_margin_bytes = int(value)

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        raise NotImplementedError("memsaver.compat does not expose CPU backups as tensors")

    def set_disk_backup_dir(self, path: str) -> None:
        raise NotImplementedError("memsaver has no disk backup; use enable_cpu_backup=True")


#: The instance to import in place of ``torch_memory_saver.torch_memory_saver``.
torch_memory_saver = TorchMemorySaver()
