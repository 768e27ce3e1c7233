"""Backups chosen when pausing (``pause(..., backup=)``, ``discard``) and when resuming
(``resume(..., keep_backups=)``), ``allocations()``, and resume's out-of-memory error as a
``RuntimeError``; on the fake driver, in this process."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import memsaver
import pytest
from helpers import MiB, pattern, read, write
from memsaver import _memsaver


@pytest.fixture(autouse=True)
def loaded() -> None:
    memsaver.hook_mode()  # loads libmemsaver.so, as every public call does


@pytest.fixture
def fake() -> Iterator[ctypes.CDLL]:
    """The fake driver's test controls (fault injection)."""
    lib = ctypes.CDLL(os.environ["MEMSAVER_CUDA_LIB"])
    yield lib
    lib.fakecuda_reset_faults()


def test_a_backup_chosen_at_pause_time_is_restored(tag):
    p = _memsaver.malloc(2 * MiB, 0, tag, "discard")
    write(p, pattern(4096))
    memsaver.pause(tag, backup="cpu")
    t = memsaver.stats().tags[tag]
    assert (t.paused, t.pinned_backup_bytes) == (True, 2 * MiB)
    (a,) = memsaver.allocations(tag)
    assert (a.ptr, a.policy, a.state, a.backup, a.backup_bytes) == (p, "discard", "paused", "pinned", 2 * MiB)
    memsaver.resume(tag)
    assert read(p, 4096) == pattern(4096)
    _memsaver.free(p)


def test_discard_chosen_at_pause_time_drops_the_contents_and_old_backups(tag):
    p = _memsaver.malloc(2 * MiB, 0, tag, "cpu")
    write(p, pattern(4096, 1))
    memsaver.pause(tag)
    memsaver.resume(tag)  # retention keeps a backup holding pattern 1
    write(p, pattern(4096, 2))
    memsaver.pause(tag, backup="discard")
    assert memsaver.stats().tags[tag].backup_bytes == 0
    memsaver.resume(tag)
    assert read(p, 4096) not in (pattern(4096, 1), pattern(4096, 2))
    _memsaver.free(p)


def test_discard_of_resident_and_paused_tags(tag, tag2):
    resident = _memsaver.malloc(2 * MiB, 0, tag, "cpu")
    paused = _memsaver.malloc(2 * MiB, 0, tag2, "mmap")
    write(resident, pattern(4096, 3))
    write(paused, pattern(4096, 4))
    memsaver.pause(tag2)
    assert memsaver.stats().tags[tag2].mmap_backup_bytes == 2 * MiB
    free_before = memsaver.device_memory(0)[0]
    memsaver.discard(tag, tag2)
    stats = memsaver.stats()
    assert memsaver.device_memory(0)[0] == free_before + 2 * MiB
    for t in (tag, tag2):
        assert stats.tags[t].paused and stats.tags[t].resident_bytes == 0
        assert stats.tags[t].backup_bytes == 0
    memsaver.resume(tag, tag2)
    assert read(resident, 4096) != pattern(4096, 3)
    assert read(paused, 4096) != pattern(4096, 4)
    # The allocations' own policies apply to the next cycle.
    write(resident, pattern(4096, 5))
    memsaver.pause(tag)
    memsaver.resume(tag)
    assert read(resident, 4096) == pattern(4096, 5)
    _memsaver.free(resident)
    _memsaver.free(paused)


def test_resume_keeps_or_releases_backups_when_asked(tag):
    assert memsaver.retain_backups()
    p = _memsaver.malloc(2 * MiB, 0, tag, "cpu")
    write(p, pattern(4096, 6))
    memsaver.pause(tag)
    memsaver.resume(tag, keep_backups=False)
    assert read(p, 4096) == pattern(4096, 6)
    assert memsaver.stats().tags[tag].backup_bytes == 0
    assert memsaver.retain_backups(), "the setting is unchanged"
    memsaver.set_retain_backups(False)
    try:
        memsaver.pause(tag)
        memsaver.resume(tag, keep_backups=True)
        assert memsaver.stats().tags[tag].pinned_backup_bytes == 2 * MiB
    finally:
        memsaver.set_retain_backups(True)
    _memsaver.free(p)


def test_bad_choices_raise_and_change_nothing(tag):
    p = _memsaver.malloc(2 * MiB, 0, tag, "cpu")
    with pytest.raises(memsaver.InvalidArgumentError, match="unknown backup policy 'tape'"):
        memsaver.pause(tag, backup="tape")  # type: ignore[arg-type]
    with pytest.raises(memsaver.UnknownTagError, match="unknown tag 'no_such_tag'"):
        memsaver.pause(tag, "no_such_tag", backup="discard")
    with pytest.raises(memsaver.UnknownTagError):
        memsaver.discard("no_such_tag")
    with pytest.raises(memsaver.UnknownTagError):
        memsaver.resume("no_such_tag", keep_backups=False)
    with pytest.raises(memsaver.UnknownTagError):
        memsaver.allocations("no_such_tag")
    with pytest.raises(TypeError, match="keep_backups"):
        memsaver.resume(tag, keep_backups=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="separate str arguments"):
        memsaver.discard([tag])  # type: ignore[arg-type]
    for call in (lambda: memsaver.discard("nccl"), lambda: memsaver.pause("nccl", backup="cpu")):
        with pytest.raises(memsaver.InvalidArgumentError, match="'nccl'"):
            call()
    with pytest.raises(memsaver.InvalidArgumentError, match="nccl"):
        memsaver.allocations("nccl")
    assert not memsaver.stats().tags[tag].paused
    _memsaver.free(p)


def test_resume_out_of_memory_is_a_runtime_error(tag, fake):
    assert issubclass(memsaver.ResumeOutOfMemoryError, RuntimeError)
    assert issubclass(memsaver.MemsaverError, RuntimeError)
    p = _memsaver.malloc(2 * MiB, 0, tag, "cpu")
    write(p, pattern(4096, 8))
    memsaver.pause(tag)
    fake.fakecuda_fail_create_at(1)
    with pytest.raises(RuntimeError, match="resume ran out of device memory") as e:
        memsaver.resume(tag, keep_backups=False)
    assert type(e.value) is memsaver.ResumeOutOfMemoryError
    (a,) = memsaver.allocations(tag)
    assert (a.state, a.backup) == ("paused", "pinned"), "still paused, with its backup"
    memsaver.resume(tag, keep_backups=False)
    assert read(p, 4096) == pattern(4096, 8)
    _memsaver.free(p)
