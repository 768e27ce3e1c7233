"""Backup policies (cpu, mmap, disk), retention, backup pointers, the disk directory, the memory
margin and whole-process mode, through the public API on the fake driver."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import memsaver
import pytest
from helpers import CUDA_SUCCESS, MiB, pattern, read, run_python, write
from memsaver import _memsaver


@pytest.fixture
def no_retention() -> Iterator[None]:
    """Retention off for one test (it is process-wide), restored afterwards."""
    before = memsaver.retain_backups()
    memsaver.set_retain_backups(False)
    try:
        yield
    finally:
        memsaver.set_retain_backups(before)


@pytest.fixture
def disk_dir(tmp_path) -> Iterator[str]:
    d = tmp_path / "backups"
    memsaver.set_disk_dir(d)
    try:
        yield str(d)
    finally:
        memsaver.set_disk_dir(None)


@pytest.mark.parametrize("backup", ["cpu", "mmap", "disk"])
def test_each_policy_restores_contents_over_cycles(hooks, tag, disk_dir, backup):
    size = 4 * MiB
    with memsaver.region(tag, backup=backup):
        p = hooks.malloc_ok(size)
    for seed in range(3):
        data = pattern(size, seed)
        write(p, data)
        memsaver.pause(tag)
        memsaver.resume(tag)
        assert read(p, size) == data, f"{backup}, cycle {seed}"
    assert hooks.free(p) == CUDA_SUCCESS
    assert os.listdir(disk_dir) == []


def test_stats_split_backup_bytes_by_kind(hooks, tag, disk_dir):
    ptrs = []
    for backup, size in (("cpu", 2 * MiB), ("mmap", 4 * MiB), ("disk", 6 * MiB)):
        with memsaver.region(f"{tag}_{backup}", backup=backup):  # type: ignore[arg-type]
            ptrs.append(hooks.malloc_ok(size))
    memsaver.pause(f"{tag}_cpu", f"{tag}_mmap", f"{tag}_disk")
    s = memsaver.stats().tags
    assert (s[f"{tag}_cpu"].pinned_backup_bytes, s[f"{tag}_cpu"].backup_bytes) == (2 * MiB,) * 2
    assert (s[f"{tag}_mmap"].mmap_backup_bytes, s[f"{tag}_mmap"].backup_bytes) == (4 * MiB,) * 2
    disk = s[f"{tag}_disk"]
    assert (disk.disk_backup_bytes, disk.backup_bytes) == (6 * MiB, 0)
    assert disk.usage.disk_backup_bytes == 6 * MiB
    assert memsaver.stats().total.disk_backup_bytes >= 6 * MiB
    memsaver.resume(f"{tag}_cpu", f"{tag}_mmap", f"{tag}_disk")
    for p in ptrs:
        assert hooks.free(p) == CUDA_SUCCESS


def test_backup_pointer_is_stable_while_retained(hooks, tag):
    assert memsaver.retain_backups() is True
    with memsaver.region(tag, backup="mmap"):
        p = hooks.malloc_ok(2 * MiB)
    assert _memsaver.backup_pointer(p, 2 * MiB) == 0, "never paused"
    write(p, b"retained")
    memsaver.pause(tag)
    b = _memsaver.backup_pointer(p, 2 * MiB)
    assert b and read(b, 8) == b"retained"
    assert _memsaver.backup_pointer(p + 4096, 16) == b + 4096, "interior pointer"
    assert _memsaver.backup_pointer(p + 4096, 2 * MiB) == 0, "past the end"
    memsaver.resume(tag)
    assert _memsaver.backup_pointer(p, 1) == b
    memsaver.pause(tag)
    assert _memsaver.backup_pointer(p, 1) == b, "reused by the next pause"
    memsaver.resume(tag)
    assert hooks.free(p) == CUDA_SUCCESS
    assert _memsaver.backup_pointer(p, 1) == 0


def test_without_retention_backups_go_at_resume(hooks, tag, disk_dir, no_retention):
    assert memsaver.retain_backups() is False
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(2 * MiB)
    with memsaver.region(tag, backup="disk"):
        q = hooks.malloc_ok(2 * MiB)
    write(p, b"p")
    write(q, b"q")
    memsaver.pause(tag)
    assert _memsaver.backup_pointer(p, 1) != 0
    assert len(os.listdir(disk_dir)) == 1
    memsaver.resume(tag)
    assert (read(p, 1), read(q, 1)) == (b"p", b"q")
    assert _memsaver.backup_pointer(p, 1) == 0
    assert os.listdir(disk_dir) == []
    t = memsaver.stats().tags[tag]
    assert (t.backup_bytes, t.disk_backup_bytes) == (0, 0)
    hooks.free(p)
    hooks.free(q)


def test_disk_without_directory_is_refused(hooks, tag):
    memsaver.set_disk_dir(None)
    with memsaver.region(tag, backup="disk"):
        p = hooks.malloc_ok(2 * MiB)
    write(p, b"still here")
    with pytest.raises(memsaver.InvalidArgumentError, match="memsaver.set_disk_dir"):
        memsaver.pause(tag)
    t = memsaver.stats().tags[tag]
    assert not t.paused and t.resident_bytes == 2 * MiB
    assert read(p, 10) == b"still here"
    hooks.free(p)


def test_set_disk_dir_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(memsaver.InvalidArgumentError, match="not a directory"):
        memsaver.set_disk_dir(f)
    d = tmp_path / "a" / "b"
    memsaver.set_disk_dir(d)
    assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700
    memsaver.set_disk_dir(None)


def test_memory_margin_stops_resume_until_lowered(hooks, tag):
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(2 * MiB)
    write(p, b"margin")
    memsaver.pause(tag)
    free, _ = memsaver.device_memory(0)
    memsaver.set_memory_margin(free)
    try:
        with pytest.raises(memsaver.ResumeOutOfMemoryError, match="memory margin"):
            memsaver.resume(tag)
        assert memsaver.stats().tags[tag].paused
    finally:
        memsaver.set_memory_margin(0)
    memsaver.resume(tag)
    assert read(p, 6) == b"margin"
    hooks.free(p)


def test_unknown_policy_lists_the_accepted_ones(tag):
    with pytest.raises(memsaver.InvalidArgumentError, match="'discard', 'cpu', 'mmap' or 'disk'"):
        with memsaver.region(tag, backup="tape"):  # type: ignore[arg-type]
            pass


def test_region_current_reports_the_thread_region(tag):
    assert json.loads(_memsaver.region_current_json())["tag"] is None
    with memsaver.region(tag, backup="mmap"):
        cur = json.loads(_memsaver.region_current_json())
        assert (cur["tag"], cur["policy"], cur["process"]) == (tag, "mmap", False)
        with memsaver.disable():
            assert json.loads(_memsaver.region_current_json())["disabled"] is True


RSS_PROCESS = r"""
import ctypes, json
import memsaver
from memsaver import _memsaver

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")

size = 64 << 20
memsaver.set_retain_backups(False)
p = _memsaver.malloc(size, 0, "rss", "mmap")
ctypes.memset(p, 0x5A, size)
out = {"before": rss_anon()}
memsaver.pause("rss")
out["paused"] = rss_anon()
out["backup"] = _memsaver.backup_pointer(p, size) != 0
memsaver.resume("rss")
out["resumed"] = rss_anon()
out["intact"] = ctypes.string_at(p + size - 4096, 4096) == b"\x5a" * 4096
print(json.dumps(out))
"""


def test_mmap_backup_is_given_back_to_the_kernel(child_env):
    """The fake driver's device memory is a shared file mapping (RssShmem), so RssAnon moves by
    the mmap backup alone: up at pause, down again after a resume without retention."""
    r = run_python(RSS_PROCESS, child_env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    grown = out["paused"] - out["before"]
    dropped = out["paused"] - out["resumed"]
    assert out["backup"] and out["intact"]
    assert 56 * MiB <= grown <= 80 * MiB, out
    assert 56 * MiB <= dropped <= 80 * MiB, out


WHOLE_PROCESS = r"""
import ctypes, json
import memsaver
from memsaver import _memsaver

memsaver.hook_mode()
lib = ctypes.CDLL(memsaver.preload_path())
lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
lib.cudaFree.argtypes = [ctypes.c_void_p]
out = {"current": json.loads(_memsaver.region_current_json())}
p = ctypes.c_void_p()
out["malloc"] = lib.cudaMalloc(ctypes.byref(p), 2 << 20)
ctypes.memset(p.value, 0x42, 2 << 20)
out["retain"] = memsaver.retain_backups()
memsaver.pause("default")
q = ctypes.c_void_p()
out["malloc_while_paused"] = lib.cudaMalloc(ctypes.byref(q), 2 << 20)
with memsaver.disable():
    out["disabled_malloc"] = lib.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 2 << 20)
memsaver.resume("default")
out["intact"] = ctypes.string_at(p.value, 16) == b"\x42" * 16
out["backup_after_resume"] = _memsaver.backup_pointer(p.value, 1)
out["tag"] = memsaver.stats().tags["default"].allocations
print(json.dumps(out))
"""


def test_whole_process_mode_from_torch_memory_saver_variables(child_env):
    env = dict(
        child_env,
        TMS_INIT_ENABLE="1",
        TMS_INIT_ENABLE_CPU_BACKUP="1",
        TMS_INIT_CPU_BACKUP_BACKEND="mmap",
    )
    r = run_python(WHOLE_PROCESS, env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["current"]["tag"] == "default" and out["current"]["policy"] == "mmap"
    assert out["current"]["process"] is True
    assert out["malloc"] == 0 and out["malloc_while_paused"] == 0
    assert out["disabled_malloc"] != 0, "a disabled scope forwards to libcudart (absent here)"
    assert out["retain"] is False, "TMS_* set without TMS_RETAIN_CPU_BACKUP: retention off"
    assert out["intact"] and out["backup_after_resume"] == 0
    assert out["tag"] == 2
