"""A measured memory timeline: pause/resume calls and profile steps recorded as events (start,
duration, tags, resident bytes per tag before and after, device free and total memory, memory
shared with other processes), a self-contained HTML page that charts them on a time axis, and
an export to the Chrome trace event format (Perfetto, chrome://tracing).

Recording is off by default. Turn it on with :func:`enable` or ``MEMSAVER_TIMELINE=PATH`` (the
events are written to PATH, with ``{pid}`` replaced by the process id, at exit and on
:func:`save`). Render with ``memsaver timeline events.json [more.json] -o out.html``, export with
``--trace out.json``.

Every pause, resume and profile step is also an NVTX range (Nsight Systems) and a
``torch.profiler.record_function`` range (torch.profiler traces) when the application has
imported torch and CUDA is available, whether recording is on or not. memsaver never imports
torch itself.

Event fields (``version`` 3 of the file; older files are still read, a missing field as none:
version 2 files lack ``shared_exports`` and ``shared_imports``, version 1 files also lack the
``*_before`` fields, ``start``, ``tid``, ``tags`` and ``device_total``):

``time``/``start``
    wall-clock seconds (``time.time()``) at the end and at the start of the span. Both come
    from one monotonic clock anchored to the wall clock once per process, so spans of a process
    never overlap wrongly; processes on one host share the wall clock.
``seconds``
    the duration; ``kind``: ``pause``, ``resume`` or ``step``; ``label``; ``stage``;
    ``tags``: the tags a pause or resume names (every tag: empty list).
``resident_before``/``resident``
    resident bytes per tag of this process at the start and at the end.
``device``, ``device_free_before``/``device_free``, ``device_total``
    the device and its free and total memory (all processes) at the start and at the end.
``shared_exports``/``shared_imports``
    memory shared with other processes through CUDA IPC handles at the end (``stats()``'s
    ``shared_exports`` and ``shared_imports``): per tag of this process that gave out handles,
    its ``bytes``, ``handles`` and ``importers``; and this process's imports of other
    processes' memory: their ``count``, ``bytes`` and how many are ``paused`` by their owner.
``error``
    present when the span raised: the exception's type and message.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from . import _core, _memsaver, _stats, _torch
from ._chromium import browser, screenshot
from ._timeline_model import PALETTE, WELL_KNOWN, colour
from ._timeline_page import render_html
from ._timeline_trace import to_chrome_trace

__all__ = [
    "PALETTE", "WELL_KNOWN", "browser", "colour", "enable", "enabled", "events", "load", "record",
    "render_html", "save", "screenshot", "span", "stage_context", "to_chrome_trace", "write_html",
    "write_trace",
]

VERSION = 3

_lock = threading.Lock()  # guards _events and _path
_context = threading.local()  # .stage: the profile stage running on this thread, if any
_events: list[dict[str, Any]] | None = None
_path: str | None = None
# The wall clock at one instant of the monotonic clock: every timestamp is
# _WALL0 + (perf_counter() - _PERF0), so a span's start and end never cross (NTP steps of the
# wall clock do not reach them).
_WALL0, _PERF0 = time.time(), time.perf_counter()


def _wall(perf: float) -> float:
    return _WALL0 + (perf - _PERF0)


def enable(path: str | None = None) -> None:
    """Starts recording events in this process; ``path`` (optional, ``{pid}`` expanded) is
    where :func:`save` and process exit write them."""
    global _events, _path
    with _lock:
        if _events is None:
            _events = []
            atexit.register(_save_at_exit)
        if path:
            _path = path.replace("{pid}", str(os.getpid()))


def enabled() -> bool:
    return _events is not None


def _from_env() -> None:
    p = os.environ.get("MEMSAVER_TIMELINE")
    if p and _events is None:
        enable(p)


def events() -> list[dict[str, Any]]:
    """A copy of the events recorded so far."""
    with _lock:
        return list(_events or [])


class stage_context:
    """Marks the events recorded on this thread inside the block as steps of ``stage``."""

    def __init__(self, stage: str) -> None:
        self.stage, self.outer = stage, None

    def __enter__(self) -> None:
        self.outer = getattr(_context, "stage", None)
        _context.stage = self.stage

    def __exit__(self, *exc: object) -> None:
        _context.stage = self.outer


class _State(NamedTuple):
    """What an event records of this process at one instant (the fields of the same names)."""

    resident: dict[str, int]
    device: int
    free: int | None
    total: int | None
    shared_exports: dict[str, dict[str, int]]
    shared_imports: dict[str, int]


def _snapshot() -> _State:
    """Resident bytes per tag of this process, the device with its free and total memory, and
    the memory shared with other processes."""
    # memsaver.stats() and memsaver.device_memory(), from below the module that defines them
    # (memsaver._api, whose pause and resume record here).
    _core.ensure_loaded()
    stats = _stats.parse(_memsaver.stats_json())
    resident = {name: t.resident_bytes for name, t in stats.tags.items()}
    exports = {
        tag: {"bytes": e.bytes, "handles": e.handles, "importers": e.importers}
        for tag, e in stats.shared_exports.items()
    }
    imports = {
        "count": len(stats.shared_imports),
        "bytes": sum(i.bytes for i in stats.shared_imports),
        "paused": sum(1 for i in stats.shared_imports if i.paused),
    }
    torch = _torch.cuda_initialized()
    device = torch.cuda.current_device() if torch is not None else 0
    try:
        free, total = _memsaver.device_memory(device)
    except Exception:  # a process without that device: keep the event without it
        free, total = None, None
    return _State(resident, device, free, total, exports, imports)


def _append(ev: dict[str, Any]) -> None:
    with _lock:
        if _events is not None:
            _events.append(ev)


def record(kind: str, label: str, seconds: float | None = None) -> None:
    """Appends an event that ends now, with the current resident bytes per tag (no-op when not
    recording). :func:`span` records the state before the event as well; prefer it."""
    if _events is None:
        return
    end = time.perf_counter()
    now = _snapshot()
    _append({
        "time": _wall(end),
        "start": None if seconds is None else _wall(end - seconds),
        "pid": os.getpid(),
        "tid": threading.get_native_id(),
        "kind": kind,
        "label": label,
        "stage": getattr(_context, "stage", None),
        "seconds": seconds,
        "resident": now.resident,
        "device": now.device,
        "device_free": now.free,
        "device_total": now.total,
        "shared_exports": now.shared_exports,
        "shared_imports": now.shared_imports,
    })


def _torch_ranges() -> Any:
    """torch, when the application imported it and CUDA is available (never imported here)."""
    return _torch.torch_module()


class span:
    """A pause, resume or profile step: an NVTX range and a ``torch.profiler.record_function``
    range around the block when torch is in use, and (when recording, and ``record`` is true)
    a timeline event with the state before and after the block. The event is recorded also
    when the block raises, with ``error``; the ranges are closed whatever happens."""

    def __init__(self, kind: str, label: str, tags: list[str] | None = None, record: bool = True) -> None:
        self.kind, self.label, self.tags, self.record = kind, label, tags, record
        self._nvtx: Any = None
        self._function: Any = None
        self._before: _State | None = None
        self._stage: str | None = None
        self._t0 = 0.0

    def _range_name(self) -> str:
        return "memsaver " + (f"{self._stage}: " if self._stage else "") + self.label

    def __enter__(self) -> span:
        self._stage = getattr(_context, "stage", None)
        torch = _torch_ranges()
        if torch is not None:
            name = self._range_name()
            try:
                torch.cuda.nvtx.range_push(name)
                self._nvtx = torch.cuda.nvtx
            except Exception:  # a torch without NVTX: the range is only a convenience
                self._nvtx = None
            try:
                function = torch.profiler.record_function(name)
                function.__enter__()
                self._function = function
            except Exception:
                self._function = None
        if self.record and _events is not None:
            self._before = _snapshot()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        end = time.perf_counter()
        try:
            if self._before is not None:
                self._record(end, exc)
        finally:
            try:
                if self._function is not None:
                    self._function.__exit__(exc_type, exc, tb)
            finally:
                if self._nvtx is not None:
                    self._nvtx.range_pop()

    def _record(self, end: float, exc: BaseException | None) -> None:
        before = self._before
        assert before is not None
        try:
            after = _snapshot()
        except Exception:  # the failure also broke stats(): keep what is known
            if exc is None:
                raise
            after = before._replace(free=None)
        ev: dict[str, Any] = {
            "time": _wall(end),
            "start": _wall(self._t0),
            "pid": os.getpid(),
            "tid": threading.get_native_id(),
            "kind": self.kind,
            "label": self.label,
            "stage": self._stage,
            "seconds": end - self._t0,
            "resident_before": before.resident,
            "resident": after.resident,
            "device": after.device,
            "device_free_before": before.free,
            "device_free": after.free,
            "device_total": after.total if after.total is not None else before.total,
            "shared_exports": after.shared_exports,
            "shared_imports": after.shared_imports,
        }
        if self.tags is not None:
            ev["tags"] = list(self.tags)
        if exc is not None:
            ev["error"] = f"{type(exc).__name__}: {exc}"
        _append(ev)


def save(path: str | None = None) -> str:
    """Writes the events as JSON to ``path`` (or the path given to :func:`enable`)."""
    target = path or _path
    if not target:
        raise ValueError("no path: pass one, or enable(path) / MEMSAVER_TIMELINE=PATH")
    with open(target, "w", encoding="utf-8") as f:
        json.dump({"version": VERSION, "events": events()}, f)
    return target


def _save_at_exit() -> None:
    if _path:
        try:
            save()
        except OSError:
            pass


def load(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Events of several files (processes), in time order. Raises ``ValueError`` naming the
    file when one holds no events."""
    out: list[dict[str, Any]] = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
        evts = data.get("events") if isinstance(data, Mapping) else data
        if not isinstance(evts, list):
            raise ValueError(f"{p}: not a memsaver timeline (no 'events' list)")
        for e in evts:
            if not isinstance(e, Mapping) or not {"time", "pid", "label", "resident"} <= e.keys():
                raise ValueError(f"{p}: an event lacks time, pid, label or resident: {e!r:.200}")
        out.extend(evts)
    return sorted(out, key=lambda e: e["time"])


def write_html(paths: Iterable[str], out: str, title: str = "memsaver timeline") -> str:
    """Renders the events of ``paths`` into the self-contained page ``out``."""
    page = render_html(load(paths), title)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out


def write_trace(paths: Iterable[str], out: str) -> str:
    """Exports the events of ``paths`` to ``out`` in the Chrome trace event format (JSON)."""
    trace = to_chrome_trace(load(paths))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(trace, f, allow_nan=False)
    return out

