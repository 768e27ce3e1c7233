"""Export of timeline events to the Chrome trace event format (the JSON that Perfetto,
ui.perfetto.dev, and chrome://tracing open).

Per process (``pid``): metadata events (``ph: "M"``) naming it and its threads; a complete
event (``ph: "X"``) per pause, resume and profile step on its thread, inside a complete event
per stage run; and counter events (``ph: "C"``) before and after every span: ``resident bytes``
(one series per tag) and ``device bytes`` (``tagged``, ``untagged``, ``free``: their sum is the
device's total); for a process that shared memory with others through CUDA IPC, also after every
span: ``exported bytes`` (one series per tag that gave out handles), ``imported bytes``
(``imported``) and ``imports`` (``mapped``, ``paused``: their sum is the imports open).
Timestamps are microseconds since the first event's start (its wall-clock time is
``otherData.memsaver_epoch_s``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import _timeline_model as model


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _dur(a: float, b: float, t0: float) -> float:
    # From the two ends as placed on the axis (not from "seconds"), so that a slice ends where
    # the slice holding it ends, to the rounding.
    return round(_us(b, t0) - _us(a, t0), 3)


def _shared_series(p: model.Process, t0: float) -> list[tuple[str, list[tuple[float, dict[str, int]]]]]:
    """The counters of the memory ``p`` shared with other processes, sampled at the end of each
    span: those it never had (no export, no import) are left out."""
    exported = model.tag_order({t for e in p.events for t in model.shared_exports(e)})
    imported = any(model.shared_imports(e)["count"] for e in p.events)
    exports_ts: list[tuple[float, dict[str, int]]] = []
    bytes_ts: list[tuple[float, dict[str, int]]] = []
    imports_ts: list[tuple[float, dict[str, int]]] = []
    for e in sorted(p.events, key=model.end):
        ts = _us(model.end(e), t0)
        exports, imports = model.shared_exports(e), model.shared_imports(e)
        exports_ts.append((ts, {t: exports.get(t, {}).get("bytes", 0) for t in exported}))
        bytes_ts.append((ts, {"imported": imports["bytes"]}))
        imports_ts.append((ts, {"mapped": imports["count"] - imports["paused"], "paused": imports["paused"]}))
    out = [("exported bytes", exports_ts)] if exported else []
    if imported:
        out += [("imported bytes", bytes_ts), ("imports", imports_ts)]
    return out


def to_chrome_trace(evts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The events (of one or several processes) as a Chrome trace: a JSON-serialisable object
    ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``."""
    procs = model.processes(evts)
    t0 = min((model.start(e) for e in evts), default=0.0)
    tags = model.tag_order({t for e in evts for t in e["resident"]})  # every tag, with memory or not
    out: list[dict[str, Any]] = []
    for index, p in enumerate(procs):
        meta = {"pid": p.pid, "tid": p.pid, "ts": 0}
        device = "" if p.device is None else f", device {p.device}"
        out.append({**meta, "ph": "M", "name": "process_name", "args": {"name": f"memsaver pid {p.pid}{device}"}})
        out.append({**meta, "ph": "M", "name": "process_sort_index", "args": {"sort_index": index}})
        tids = sorted({e.get("tid") or p.pid for e in p.events})
        for tid in tids:
            name = "main thread" if tid == p.pid else f"thread {tid}"
            out.append({"pid": p.pid, "tid": tid, "ts": 0, "ph": "M", "name": "thread_name",
                        "args": {"name": f"memsaver steps ({name})"}})
        slices: list[dict[str, Any]] = []
        for st, a, b, tid in p.stage_runs():
            slices.append({"ph": "X", "cat": "stage", "name": f"stage {st}", "pid": p.pid, "tid": tid or p.pid,
                           "ts": _us(a, t0), "dur": _dur(a, b, t0), "args": {"stage": st}})
        for e in p.events:
            after = e["resident"]
            before = e.get("resident_before")
            changed = {t: after.get(t, 0) - before.get(t, 0) for t in set(after) | set(before)} if before else {}
            args: dict[str, Any] = {
                "stage": e.get("stage"),
                "tags": list(e["tags"]) if "tags" in e else sorted(t for t, d in changed.items() if d),
                "ms": round(float(e.get("seconds") or 0.0) * 1e3, 4),
                "resident_bytes": dict(after),
            }
            if before is not None:
                args["bytes"] = sum(changed.values())  # this process's resident bytes gained (< 0: released)
            if e.get("device_free") is not None:
                args["device_free_bytes"] = e["device_free"]
            if model.shared_exports(e):
                args["shared_exports"] = model.shared_exports(e)
            if model.shared_imports(e)["count"]:
                args["shared_imports"] = model.shared_imports(e)
            if e.get("error"):
                args["error"] = e["error"]
            slices.append({
                "ph": "X", "cat": e.get("kind") or "step", "name": e["label"], "pid": p.pid,
                "tid": e.get("tid") or p.pid, "ts": _us(model.start(e), t0),
                "dur": _dur(model.start(e), model.end(e), t0), "args": args,
            })
        # Per thread in ts order, an enclosing slice before the slices it holds.
        slices.sort(key=lambda s: (s["tid"], s["ts"], -s["dur"]))
        out.extend(slices)
        resident_ts: list[tuple[float, dict[str, int]]] = []
        device_ts: list[tuple[float, dict[str, int]]] = []
        for s in p.samples():
            ts = _us(s.t, t0)
            resident = {t: int(s.resident.get(t, 0)) for t in tags}
            if resident:  # a counter event needs at least one series
                resident_ts.append((ts, resident))
            if s.free is not None and s.total is not None:
                tagged = sum(resident.values())
                device_ts.append((ts, {"tagged": tagged, "untagged": s.untagged() or 0, "free": s.free}))
            elif s.free is not None:
                device_ts.append((ts, {"free": s.free}))
        for name, series in (("resident bytes", resident_ts), ("device bytes", device_ts), *_shared_series(p, t0)):
            by_ts: dict[float, dict[str, int]] = {}
            for ts, values in series:  # one sample per instant: the last one taken there
                by_ts[ts] = values
            for ts in sorted(by_ts):
                out.append({"ph": "C", "name": name, "pid": p.pid, "tid": p.pid, "ts": ts, "args": by_ts[ts]})
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"memsaver_epoch_s": t0, "producer": "memsaver timeline"},
    }
