"""Driving another process's memory: pause and resume its tags, run a profile stage in it, read
its stats. For RL jobs whose rollout engines run in subprocesses or Ray actors.

In the process to drive (a rollout worker)::

    memsaver.serve_control()                         # or start it with MEMSAVER_CONTROL=1
    memsaver.register_callback("sync_weights", sync) # what the profile's `call` steps may run

From the driver::

    from memsaver import control
    control.Target(pid=1234).pause("kv_cache")       # a process of this process's group
    rollout = control.group(200)                     # every process of group 200
    rollout.run("verl_grpo.yaml", "sleep")           # the stage runs in each, at once
    for pid, stats in rollout.stats().items(): ...

Requests travel over memsaver's own sockets, with the checks of docs/security.md: only
processes of the same user (and pid namespace) reach a process, and only the processes of the
group named (``--group``, ``group=``; this process's group by default). A process serves them
only once it opted in. ``call`` steps run only callbacks the target registered: a stage that
calls one it did not register fails before any step runs, naming it.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import _core, _memsaver, _stats
from ._memsaver import ControlError, InvalidArgumentError, MemsaverError, ProfileError
from ._stats import Stats
from .profile import ProfileStepError, StageReport, StepReport, parse_profile

__all__ = [
    "Answer",
    "ControlError",
    "Group",
    "Target",
    "group",
    "register_callback",
    "registered_callbacks",
    "serve_control",
    "unregister_callback",
]

#: Callbacks other processes' `run` requests may call, by name.
_CALLBACKS: dict[str, Callable[[], Any]] = {}
_callbacks_lock = threading.Lock()
_runner_installed = False

_NAME = re.compile(r"[A-Za-z0-9_]+")

def register_callback(name: str, fn: Callable[[], Any]) -> None:
    """Lets ``call: name`` steps of stages that other processes run in this one call ``fn``
    (no arguments). Registering a name again replaces its function."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(f"invalid callback name {name!r}: letters, digits and '_' (as in profiles)")
    if not callable(fn):
        raise TypeError(f"memsaver.register_callback({name!r}, fn): fn must be callable, got {fn!r}")
    with _callbacks_lock:
        _CALLBACKS[name] = fn
    _core.library()  # installs the stage runner


def unregister_callback(name: str) -> None:
    """Forgets the callback ``name`` (nothing if it is not registered)."""
    with _callbacks_lock:
        _CALLBACKS.pop(name, None)


def registered_callbacks() -> list[str]:
    """The names of this process's registered callbacks, sorted."""
    with _callbacks_lock:
        return sorted(_CALLBACKS)


def serve_control() -> None:
    """Serves control requests from other processes of this user and group from now on (as
    ``MEMSAVER_CONTROL=1`` does once memsaver starts in the process); see docs/security.md for
    who may send them. Raises ``ControlError`` if the socket cannot be served."""
    _core.ensure_loaded()  # installs the stage runner
    _memsaver.control_serve()


def _install_runner() -> None:
    """Installs the stage runner in libmemsaver.so, once per process (``_core`` runs it once the
    library is loaded: registered below, when this module is imported, which the package's
    ``__init__`` does before anything can load the library)."""
    global _runner_installed
    if _runner_installed:
        return
    _runner_installed = True
    _memsaver.control_set_runner(_run_request)


def _status(e: BaseException) -> int:
    """The C ABI status of `e` (the binding knows the one mapping). A failed step travels with
    the profile status and comes back as a ``ProfileStepError`` (``Answer.exception``)."""
    if isinstance(e, ProfileStepError):
        e = ProfileError(str(e))
    return _memsaver.status_of(e)


def _run_request(text: str) -> str:
    """Runs a stage for another process's request (on memsaver's control thread)."""
    try:
        req = json.loads(text)
        source, stage = str(req["source"]), str(req["stage"])
        profile = parse_profile(req["profile"], source)
        if stage not in profile.stages:
            raise ProfileStepError(f"{source} has no stage '{stage}' (stages: {', '.join(sorted(profile.stages))})")
        with _callbacks_lock:
            callbacks = dict(_CALLBACKS)
        needed = profile.stage_callbacks(stage)
        missing = [n for n in needed if n not in callbacks]
        if missing:
            raise ProfileStepError(
                f"stage '{stage}' of {source} calls {', '.join(missing)}, which process {os.getpid()} did not "
                f"register (memsaver.register_callback(name, fn) in it; registered: "
                f"{', '.join(sorted(callbacks)) or 'none'}); no step was run"
            )
        report = profile.run(stage, callbacks=callbacks)
        return json.dumps({"ok": True, "report": _report_json(report)})
    except BaseException as e:  # noqa: BLE001 - every failure is an answer, never an unwind into C
        return json.dumps({"ok": False, "status": _status(e), "error": str(e) or type(e).__name__})


def _report_json(r: StageReport) -> dict[str, Any]:
    return {
        "stage": r.stage,
        "steps": [
            {
                "index": s.index,
                "line": s.line,
                "description": s.description,
                "seconds": s.seconds,
                "resident_before": s.resident_before,
                "resident_after": s.resident_after,
                "skipped": s.skipped,
            }
            for s in r.steps
        ],
    }


def _report(doc: Mapping[str, Any]) -> StageReport:
    r = StageReport(str(doc["stage"]))
    for s in doc["steps"]:
        r.steps.append(
            StepReport(
                int(s["index"]),
                int(s["line"]),
                str(s["description"]),
                float(s["seconds"]),
                {k: int(v) for k, v in s["resident_before"].items()},
                {k: int(v) for k, v in s["resident_after"].items()},
                bool(s.get("skipped", False)),
            )
        )
    return r


@dataclass(frozen=True)
class Answer:
    """One process's answer to a control request: ``ok``, or the ``error`` (its message) and
    ``status`` (the C ABI's code: the operation's own, or 14 when the process was not reached,
    refused the request or did not answer); ``result``: ``Stats`` for stats, ``StageReport``
    for run, else None."""

    pid: int
    group: int
    ok: bool
    status: int
    error: str | None
    result: Any

    def exception(self) -> MemsaverError:
        """The exception this failed answer raises for a single target."""
        msg = f"process {self.pid} (group {self.group}): {self.error}"
        err: MemsaverError = _memsaver.error_from_status(self.status, msg)
        # A stage that failed on the target is a failed step, as when run here.
        return ProfileStepError(msg) if isinstance(err, ProfileError) else err


class _Addressed:
    def __init__(self, pid: int | None, group: int | None, timeout: float) -> None:
        if timeout <= 0:
            raise InvalidArgumentError(f"timeout must be positive seconds, got {timeout!r}")
        self._pid = pid
        self._group = group
        self._timeout = float(timeout)

    def send(self, op: str, **fields: Any) -> list[Answer]:
        """Sends one request (``op``: pause, resume, stats or run) and returns every answer,
        raising only when no process could be addressed (``ControlError``)."""
        _core.ensure_loaded()
        req = {"op": op, "pid": self._pid, "group": self._group, "timeout_s": self._timeout, **fields}
        doc = json.loads(_memsaver.control_json(json.dumps(req)))
        out = []
        for t in doc["targets"]:
            result = t["result"]
            if t["ok"] and op == "stats":
                result = _stats.parse(json.dumps(result["stats"]))
            elif t["ok"] and op == "run":
                result = _report(result)
            out.append(Answer(int(t["pid"]), int(t["group"]), bool(t["ok"]), int(t["status"]), t["error"], result))
        return out

    @staticmethod
    def _tags(fn: str, tags: tuple[Any, ...]) -> list[str]:
        for t in tags:
            if not isinstance(t, str):
                raise TypeError(f"{fn}() takes tag names as separate str arguments; got {t!r}")
        return list(tags)

    @staticmethod
    def _profile(profile: str | os.PathLike[str]) -> dict[str, str]:
        path = os.fspath(profile)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(1 << 20 | 1)
        except (OSError, UnicodeDecodeError) as e:
            raise ProfileError(f"{path}: cannot read the profile: {e}") from e
        parse_profile(text, path)  # the errors of a bad file here, not in every target
        return {"profile": text, "source": path}


class Target(_Addressed):
    """One other process, by pid, of this process's group or of ``group``. Each call waits up
    to ``timeout`` seconds for its answer and raises the target's error (its type kept:
    ``UnknownTagError``, ``PeerError``, ...; ``ProfileStepError`` for a stage;
    ``ControlError`` when it was not reached, refused or did not answer)."""

    def __init__(self, pid: int, group: int | None = None, timeout: float = 600.0) -> None:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise TypeError(f"Target(pid=...) takes a process id, got {pid!r}")
        super().__init__(pid, group, timeout)
        self.pid = pid

    def __repr__(self) -> str:
        return f"memsaver.control.Target(pid={self.pid}, group={self._group})"

    def _one(self, op: str, **fields: Any) -> Any:
        (a,) = self.send(op, **fields)
        if not a.ok:
            raise a.exception()
        return a.result

    def pause(self, *tags: str) -> None:
        """Pauses ``tags`` in the process (every tag when none is given)."""
        self._one("pause", tags=self._tags("pause", tags))

    def resume(self, *tags: str) -> None:
        """Resumes ``tags`` in the process (every tag when none is given)."""
        self._one("resume", tags=self._tags("resume", tags))

    def stats(self) -> Stats:
        """The process's ``memsaver.stats()``."""
        result: Stats = self._one("stats")
        return result

    def run(self, profile: str | os.PathLike[str], stage: str) -> StageReport:
        """Runs ``stage`` of the profile file ``profile`` in the process (its text is sent);
        ``call`` steps call the callbacks it registered."""
        report: StageReport = self._one("run", stage=stage, **self._profile(profile))
        return report


class Group(_Addressed):
    """Every live process of a group that serves a memsaver socket, but this one; each call
    goes to all of them at once (a pause of ``nccl`` completes only when every rank pauses),
    and returns the answers by pid, raising ``ControlError`` naming every process that failed
    (the answers are in its ``answers`` attribute)."""

    def __init__(self, group: int, timeout: float = 600.0) -> None:
        if isinstance(group, bool) or not isinstance(group, int):
            raise TypeError(f"memsaver.control.group() takes an int, got {group!r}")
        super().__init__(None, group, timeout)
        self.group = group

    def __repr__(self) -> str:
        return f"memsaver.control.group({self.group})"

    def _all(self, op: str, **fields: Any) -> dict[int, Any]:
        answers = self.send(op, **fields)
        failed = [a for a in answers if not a.ok]
        if failed:
            lines = "; ".join(f"process {a.pid}: {a.error}" for a in failed)
            ok = [a.pid for a in answers if a.ok]
            e = ControlError(
                f"{len(failed)} of {len(answers)} processes of group {self.group} failed: {lines}"
                + (f" (done in {', '.join(map(str, ok))})" if ok else "")
            )
            e.answers = answers  # type: ignore[attr-defined]
            raise e
        return {a.pid: a.result for a in answers}

    def pids(self) -> list[int]:
        """The processes of the group this addresses now (by their stats request)."""
        return sorted(a.pid for a in self.send("stats"))

    def pause(self, *tags: str) -> list[int]:
        """Pauses ``tags`` in every process; returns their pids."""
        return sorted(self._all("pause", tags=self._tags("pause", tags)))

    def resume(self, *tags: str) -> list[int]:
        """Resumes ``tags`` in every process; returns their pids."""
        return sorted(self._all("resume", tags=self._tags("resume", tags)))

    def stats(self) -> dict[int, Stats]:
        """Each process's stats, by pid."""
        return self._all("stats")

    def run(self, profile: str | os.PathLike[str], stage: str) -> dict[int, StageReport]:
        """Runs ``stage`` in every process at once; each one's report, by pid."""
        return self._all("run", stage=stage, **self._profile(profile))


def group(group: int, timeout: float = 600.0) -> Group:
    """Every process of ``group`` (see :class:`Group`)."""
    return Group(group, timeout)


# Last, once _run_request and all it calls are defined: on_load runs it at once if the library
# is already loaded.
_core.on_load(_install_runner)
