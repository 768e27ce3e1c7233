"""What the page and the trace export both read from recorded events: spans, the state samples
of each process (before and after every span), stage runs, the memory shared with other
processes, and the fixed colour of each tag."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Tags every RL job has keep their colour on every page; others hash into PALETTE.
WELL_KNOWN = {
    "weights": "#1f77b4",
    "optimizer": "#d62728",
    "kv_cache": "#2ca02c",
    "cuda_graph": "#ff7f0e",
    "nccl": "#9467bd",
}
PALETTE = [
    "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39",
    "#7b4173", "#3182bd", "#e6550d", "#31a354",
]
UNTAGGED = "#b8ab95"  # device memory in use that no tag of this process holds
FREE = "#e4eddc"  # free device memory


def colour(tag: str) -> str:
    """The fixed colour of ``tag``: its own for the well-known tags, else a stable hash of the
    name (CRC-32, the same in every process and run) into :data:`PALETTE`."""
    return WELL_KNOWN.get(tag) or PALETTE[zlib.crc32(tag.encode()) % len(PALETTE)]


def tag_order(tags: set[str]) -> list[str]:
    """Stacking order: the well-known tags first (in WELL_KNOWN's order), then by name."""
    known = [t for t in WELL_KNOWN if t in tags]
    return known + sorted(tags - set(WELL_KNOWN))


def start(e: Mapping[str, Any]) -> float:
    """Wall-clock start of an event (version 1 files: end minus duration)."""
    if e.get("start") is not None:
        return float(e["start"])
    return float(e["time"]) - float(e.get("seconds") or 0.0)


def end(e: Mapping[str, Any]) -> float:
    return float(e["time"])


@dataclass
class Sample:
    """The state of a process at one instant: resident bytes per tag, device free and total."""

    t: float
    resident: Mapping[str, int]
    free: int | None
    total: int | None

    def untagged(self) -> int | None:
        if self.free is None or self.total is None:
            return None
        return max(0, self.total - self.free - sum(self.resident.values()))


@dataclass
class Process:
    pid: int
    device: Any
    events: list[Mapping[str, Any]] = field(default_factory=list)

    def samples(self) -> list[Sample]:
        """Before (at its start) and after (at its end) of every event, in time order; the
        first is the starting state when the events recorded it."""
        out = []
        for e in self.events:
            total = e.get("device_total")
            if "resident_before" in e:
                out.append(Sample(start(e), e["resident_before"], e.get("device_free_before"), total))
            out.append(Sample(end(e), e["resident"], e.get("device_free"), total))
        out.sort(key=lambda s: s.t)  # stable: a before and an after at one instant keep their order
        return out

    def stage_runs(self) -> list[tuple[str, float, float, Any]]:
        """(stage, start, end, tid) of each run of a stage: consecutive events of one stage on one
        thread (two runs of one stage back to back read as one)."""
        runs: list[tuple[str, float, float, Any]] = []
        last: dict[Any, int] = {}  # tid -> index in runs of its open run
        for e in self.events:
            tid, st = e.get("tid"), e.get("stage")
            if not st:
                last.pop(tid, None)
                continue
            i = last.get(tid)
            if i is not None and runs[i][0] == st:
                runs[i] = (st, runs[i][1], max(runs[i][2], end(e)), tid)
            else:
                last[tid] = len(runs)
                runs.append((st, start(e), end(e), tid))
        return runs


def processes(evts: Sequence[Mapping[str, Any]]) -> list[Process]:
    """The events by process (in pid order), each in time order."""
    by_pid: dict[int, Process] = {}
    for e in sorted(evts, key=start):
        p = by_pid.setdefault(e["pid"], Process(e["pid"], e.get("device")))
        p.events.append(e)
    return [by_pid[pid] for pid in sorted(by_pid)]


def depths(evts: Sequence[Mapping[str, Any]]) -> list[int]:
    """Nesting depth of each event among the events of its thread (a profile step that calls
    back into memsaver.pause holds the pause's event)."""
    order = sorted(range(len(evts)), key=lambda i: (start(evts[i]), -end(evts[i])))
    out = [0] * len(evts)
    open_: dict[Any, list[float]] = {}
    for i in order:
        stack = open_.setdefault(evts[i].get("tid"), [])
        while stack and stack[-1] <= start(evts[i]):
            stack.pop()
        out[i] = len(stack)
        stack.append(end(evts[i]))
    return out


def shared_exports(e: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Per tag, the memory of the process shared with others after the event: ``bytes``,
    ``handles``, ``importers`` (none in files of version 2 and older)."""
    return {
        str(tag): {k: int(x.get(k, 0)) for k in ("bytes", "handles", "importers")}
        for tag, x in (e.get("shared_exports") or {}).items()
    }


def shared_imports(e: Mapping[str, Any]) -> dict[str, int]:
    """Other processes' memory the process has open after the event: ``count``, ``bytes`` and
    how many are ``paused`` by their owner (all 0 in files of version 2 and older)."""
    imports = e.get("shared_imports") or {}
    return {k: int(imports.get(k, 0)) for k in ("count", "bytes", "paused")}


def has_shared(evts: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any event has memory shared with other processes (exported or imported)."""
    return any(shared_exports(e) or shared_imports(e)["count"] for e in evts)


def tags_of(evts: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every tag that holds memory at some point, in stacking order."""
    seen: set[str] = set()
    for e in evts:
        for key in ("resident", "resident_before"):
            seen.update(t for t, b in (e.get(key) or {}).items() if b > 0)
    return tag_order(seen)
