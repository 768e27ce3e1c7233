"""Staged pause/resume profiles: load a YAML profile and run its stages.

    profile = memsaver.load_profile("grpo.yaml")
    with profile.region("weights"):          # the backup policy the profile declares
        model = build_model()
    profile.run("sleep")
    ...
    report = profile.run("wake", callbacks={"sync_weights": sync})
    print(report)                            # each step: time, resident bytes per tag

Parsing and validation happen in libmemsaver.so (the schema: docs/profiles.md); an invalid file
raises ``ProfileError`` naming file, line and column. A step that fails stops the stage with
``ProfileStepError`` saying which step and why; pause and resume leave every allocation paused
or resident, so the state stays consistent and the stage can be run again.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import _api, _core, _memsaver, timeline
from ._memsaver import MemsaverError


class ProfileStepError(MemsaverError):
    """A step of a profile stage failed; the message names the stage, step and line."""


@dataclass(frozen=True)
class StepReport:
    index: int
    line: int
    description: str
    seconds: float
    resident_before: dict[str, int]
    resident_after: dict[str, int]
    #: A ``call`` step not run (``skip_calls``): nothing was called.
    skipped: bool = False


@dataclass
class StageReport:
    stage: str
    steps: list[StepReport] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def __str__(self) -> str:
        tags = sorted({t for s in self.steps for t in s.resident_after})
        head = f"{'step':<40} {'ms':>9}" + "".join(f" {t:>12}" for t in tags)
        rows = [f"stage '{self.stage}' ({self.seconds * 1e3:.2f} ms)", head]
        for s in self.steps:
            cells = "".join(f" {_mib(s.resident_after.get(t, 0)):>12}" for t in tags)
            ms = "skipped" if s.skipped else f"{s.seconds * 1e3:.2f}"
            rows.append(f"{s.description:<40} {ms:>9}{cells}")
        skipped = [s.description for s in self.steps if s.skipped]
        if skipped:
            rows.append(f"not run: {', '.join(skipped)} (no callbacks were given)")
        return "\n".join(rows)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _resident() -> dict[str, int]:
    return {name: t.resident_bytes for name, t in _api.stats().tags.items()}


# What each kind of step does. The steps arrive typed and validated from libmemsaver.so (the
# schema: the `Action` enum of profile/src/lib.rs), with their `description`, `line` and
# `column`; this table only executes them.
_Step = Mapping[str, Any]
_Callbacks = Mapping[str, Callable[[], Any]]


def _pause(s: _Step, callbacks: _Callbacks, skip_calls: bool) -> None:
    _api.pause(*s["tags"])


def _resume(s: _Step, callbacks: _Callbacks, skip_calls: bool) -> None:
    _api.resume(*s["tags"])


def _call(s: _Step, callbacks: _Callbacks, skip_calls: bool) -> None:
    if not skip_calls:
        callbacks[s["name"]]()


def _assert_free(s: _Step, callbacks: _Callbacks, skip_calls: bool) -> None:
    free, _ = _memsaver.device_memory(s["device"])
    if free < s["bytes"]:
        raise ProfileStepError(
            f"device {s['device']} has {free / (1 << 30):.2f} GiB free, "
            f"expected at least {s['bytes'] / (1 << 30):.2f} GiB"
        )


def _assert_released(s: _Step, callbacks: _Callbacks, skip_calls: bool) -> None:
    t = _api.stats().tags.get(s["tag"])
    if t is not None and t.resident_bytes:
        raise ProfileStepError(f"tag '{s['tag']}' still holds {t.resident_bytes} resident bytes")


_EXECUTE: dict[str, Callable[[_Step, _Callbacks, bool], None]] = {
    "pause": _pause,
    "resume": _resume,
    "call": _call,
    "assert_free": _assert_free,
    "assert_released": _assert_released,
}
# pause and resume record their own timeline events.
_RECORDS_ITSELF = frozenset({"pause", "resume"})


class Profile:
    """A validated profile (see :func:`load_profile`)."""

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        self.source = source
        self.version: int = data["version"]
        self.tags: dict[str, str] = {t["name"]: t["backup"] for t in data["tags"]}
        self.stages: dict[str, list[dict[str, Any]]] = {s["name"]: s["steps"] for s in data["stages"]}
        self._callbacks: list[str] = list(data["callbacks"])
        self._stage_callbacks: dict[str, list[str]] = {s["name"]: s["callbacks"] for s in data["stages"]}

    def __repr__(self) -> str:
        return f"Profile({self.source!r}, tags={sorted(self.tags)}, stages={sorted(self.stages)})"

    def callbacks(self) -> list[str]:
        """Names of the callbacks the stages call, in order of first use."""
        return list(self._callbacks)

    def stage_callbacks(self, stage: str) -> list[str]:
        """Names of the callbacks ``stage`` calls, in order of first use."""
        return list(self._stage_callbacks[stage])

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        """``memsaver.region(tag, backup=...)`` with the backup policy the profile declares."""
        if tag not in self.tags:
            raise MemsaverError(
                f"tag '{tag}' is not declared in {self.source} (declared: {', '.join(sorted(self.tags))})"
            )
        with _api.region(tag, backup=self.tags[tag]):  # type: ignore[arg-type]
            yield

    def run(
        self,
        stage: str,
        callbacks: Mapping[str, Callable[[], Any]] | None = None,
        skip_calls: bool = False,
    ) -> StageReport:
        """Runs the steps of ``stage`` in order; returns their timings and resident memory.

        ``callbacks`` maps the names of ``call`` steps to functions taking no argument;
        ``skip_calls`` skips ``call`` steps (for scripts that only move memory)."""
        if stage not in self.stages:
            raise ProfileStepError(
                f"{self.source} has no stage '{stage}' (stages: {', '.join(sorted(self.stages))})"
            )
        callbacks = dict(callbacks or {})
        missing = [n for n in self._stage_callbacks[stage] if n not in callbacks]
        if missing and not skip_calls:
            raise ProfileStepError(
                f"stage '{stage}' of {self.source} calls {', '.join(missing)} but no such callback "
                "was given (pass callbacks={...}, or skip_calls=True)"
            )
        _core.ensure_loaded()
        known = set(_api.stats().tags)  # includes memsaver's own tags (nccl), never registered here
        for tag in self.tags:
            if tag not in known:
                _api.register_tag(tag)
        report = StageReport(stage)
        after = _resident()
        for i, s in enumerate(self.stages[stage], 1):
            what = s["description"]
            execute = _EXECUTE.get(s["op"])
            if execute is None:  # a libmemsaver.so newer than this package
                raise ProfileStepError(
                    f"stage '{stage}' step {i} ({what}, {self.source} line {s['line']}): this memsaver "
                    f"package cannot run '{s['op']}' steps; install the package and library of one version"
                )
            before = after  # the previous step's "after": nothing runs in between
            if s["op"] == "call" and skip_calls:
                report.steps.append(StepReport(i, s["line"], what, 0.0, before, after, skipped=True))
                continue
            t0 = time.perf_counter()
            try:
                # A span: an NVTX/record_function range, and an event unless pause/resume records it.
                with timeline.stage_context(stage), timeline.span("step", what, record=s["op"] not in _RECORDS_ITSELF):
                    execute(s, callbacks, skip_calls)
            except Exception as e:
                raise ProfileStepError(
                    f"stage '{stage}' step {i} ({what}, {self.source} line {s['line']}) failed: {e}"
                ) from e
            elapsed = time.perf_counter() - t0
            after = _resident()
            report.steps.append(StepReport(i, s["line"], what, elapsed, before, after))
        return report


def parse_profile(text: str, source: str = "<profile>") -> Profile:
    """Parses and validates profile text (``source`` names it in messages)."""
    _core.ensure_loaded()
    return Profile(json.loads(_memsaver.parse_profile(text, source)), source)


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Loads and validates the YAML profile at ``path`` (read in libmemsaver.so, at most 1 MiB);
    raises ``ProfileError`` with ``path:line:column: what was expected`` if it is invalid, or
    ``path: cannot read the profile: why`` if it cannot be read."""
    _core.ensure_loaded()
    source = os.fspath(path)
    return Profile(json.loads(_memsaver.load_profile(source)), source)
