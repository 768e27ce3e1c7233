"""The pause guard: libmemsaver.so asks the package before every pause and tells it after every
pause or resume, for pauses made here and for those other processes ask for, so that torch's
caching allocator never hands out paused memory (the guard's torch side runs on GPUs:
tests/gpu/paused_alloc.py). Here, on the fake driver, with a guard that records its calls."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import memsaver
import pytest
from memsaver import _memsaver, _torch, control

MIB = 1 << 20


@pytest.fixture
def calls() -> Iterator[list[tuple[int, list[str] | None]]]:
    """Installs a guard that records (event, tags) and refuses what `refuse` names."""
    seen: list[tuple[int, list[str] | None]] = []
    memsaver.stats()  # loads the library, which installs the package's guard

    def guard(event: int, tags: list[str] | None) -> str | None:
        seen.append((event, tags))
        if event == 0 and tags and "refused" in tags:
            return "the test's guard refuses 'refused'"
        if event == 0 and tags and "raises" in tags:
            raise ValueError("a bug in the guard")
        return None

    _memsaver.set_pause_guard(guard)
    yield seen
    _memsaver.set_pause_guard(_torch.pause_guard)


def _paused(tag: str) -> bool:
    return memsaver.stats().tags[tag].paused


def test_the_guard_hears_every_pause_and_resume(calls, tag, tag2):
    _memsaver.malloc(2 * MIB, 0, tag, "cpu")
    _memsaver.malloc(2 * MIB, 0, tag2, "discard")
    memsaver.pause(tag)
    assert calls == [(0, [tag]), (1, None)]
    calls.clear()
    memsaver.resume(tag)
    assert calls == [(1, None)]  # a resume is only told of afterwards
    calls.clear()
    memsaver.pause(tag, tag2, backup="cpu")
    assert calls == [(0, [tag, tag2]), (1, None)]
    memsaver.resume()
    calls.clear()
    memsaver.pause()  # every tag: the guard gets every tag of allocations by name
    assert calls[0][0] == 0 and {tag, tag2} <= set(calls[0][1] or [])
    assert "nccl" not in (calls[0][1] or [])  # NCCL's memory is in no torch pool
    memsaver.resume()


def test_a_refusal_changes_nothing_and_says_why(calls, tag):
    _memsaver.malloc(2 * MIB, 0, "refused", "discard")
    _memsaver.malloc(2 * MIB, 0, tag, "discard")
    with pytest.raises(memsaver.PauseRefusedError, match="the test's guard refuses 'refused'"):
        memsaver.pause(tag, "refused")
    assert not _paused(tag) and not _paused("refused")
    assert calls == [(0, [tag, "refused"]), (1, None)]  # told that the transition ended
    _memsaver.malloc(2 * MIB, 0, "raises", "discard")
    with pytest.raises(memsaver.PauseRefusedError, match="raised ValueError: a bug in the guard"):
        memsaver.pause("raises")
    assert not _paused("raises")
    memsaver.pause(tag)  # the next pause works
    assert _paused(tag)
    memsaver.resume(tag)


CHILD = r"""
import sys, time
import memsaver
from memsaver import _memsaver

memsaver.serve_control()
_memsaver.malloc(4 << 20, 0, "weights", "discard")
_memsaver.malloc(4 << 20, 0, "kv_cache", "discard")
def guard(event, tags):
    if event == 0 and "kv_cache" in tags:
        return "kv_cache has an open region in process " + str(__import__("os").getpid())
    return None
_memsaver.set_pause_guard(guard)
print("ready", flush=True)
time.sleep(120)
"""


def test_a_pause_asked_by_another_process_goes_through_the_guard(child_env):
    group = 1_234_567
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=dict(child_env, MEMSAVER_GROUP=str(group)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "ready", (line, p.stderr.read() if p.poll() is not None else "")
        target = control.Target(p.pid, group=group)
        with pytest.raises(memsaver.PauseRefusedError, match=f"open region in process {p.pid}"):
            target.pause("kv_cache", "weights")
        s = target.stats()
        assert not s.tags["kv_cache"].paused and not s.tags["weights"].paused
        target.pause("weights")
        assert target.stats().tags["weights"].paused
    finally:
        p.kill()
        p.wait()


PRELOADED_CHILD = r"""
import memsaver
from memsaver import _memsaver
# Under the preload, importing the package installs what it installs in libmemsaver.so.
print(_memsaver.loaded() is not None and _memsaver.loaded()[0])
"""


def test_under_the_preload_the_guard_is_installed_at_import(child_env):
    env = dict(child_env, LD_PRELOAD=memsaver.preload_path())
    r = subprocess.run([sys.executable, "-c", PRELOADED_CHILD], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "preload"
    r = subprocess.run([sys.executable, "-c", PRELOADED_CHILD], env=child_env, capture_output=True, text=True)
    assert r.stdout.strip() == "False"  # without it, import loads nothing
