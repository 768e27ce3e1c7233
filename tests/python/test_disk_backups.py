"""Disk backups against other users and other processes, with real processes on the fake
driver: the directory's owner and mode, files another user cannot read, write or plant, the
integrity check of resume, cleanup at exit and after a killed process, diagnostics of leftover
files, and a pause whose every disk write fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import memsaver
import pytest
from helpers import CUDA_SUCCESS, MiB, as_nobody, pattern, read, run_python, write


@pytest.fixture
def unset_disk_dir() -> Iterator[None]:
    """The disk directory is process-wide: unset again after the test."""
    try:
        yield
    finally:
        memsaver.set_disk_dir(None)


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip(
            "needs root: the test makes a directory of another user (chown) or switches to "
            "uid 65534 in a forked child (os.setuid); run the tests as root to cover it"
        )


def test_a_directory_others_can_write_is_refused(tmp_path, unset_disk_dir):
    st = os.stat("/tmp")
    mode = f"{st.st_mode & 0o7777:04o}"
    with pytest.raises(memsaver.InvalidArgumentError, match=f"belongs to uid {st.st_uid} with mode {mode}"):
        memsaver.set_disk_dir("/tmp")
    d = tmp_path / "ours"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(memsaver.InvalidArgumentError, match="mode 0777.*chmod go-w"):
        memsaver.set_disk_dir(d)
    os.chmod(d, 0o755)
    memsaver.set_disk_dir(d)  # readable by others: accepted (the files are 0600)


PAUSE_IN_ENV_DIR = r"""
import ctypes, json
import memsaver
from memsaver import _memsaver

memsaver.hook_mode()  # loads the library
p = _memsaver.malloc(2 << 20, 0, "envdir", "disk")
ctypes.memset(p, 0x61, 2 << 20)
out = {}
try:
    memsaver.pause("envdir")
except memsaver.MemsaverError as e:
    out["error"] = f"{type(e).__name__}: {e}"
t = memsaver.stats().tags["envdir"]
out["paused"], out["resident"] = t.paused, t.resident_bytes
out["intact"] = ctypes.string_at(p, 2 << 20) == b"\x61" * (2 << 20)
print(json.dumps(out))
"""


def test_a_refused_directory_from_the_environment_fails_the_pause_and_changes_nothing(child_env):
    r = run_python(PAUSE_IN_ENV_DIR, dict(child_env, MEMSAVER_DISK_DIR="/tmp"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["error"].startswith("InvalidArgumentError: ") and "MEMSAVER_DISK_DIR: " in out["error"], out
    assert "/tmp belongs to uid" in out["error"], out
    assert (out["paused"], out["resident"], out["intact"]) == (False, 2 * MiB, True), out


def test_another_users_directory_is_refused(unset_disk_dir):
    _needs_root()
    base = Path(tempfile.mkdtemp(prefix="memsaver-theirs-"))
    try:
        d = base / "backups"
        d.mkdir()
        os.chmod(d, 0o777)
        os.chown(d, 65534, 65534)
        with pytest.raises(memsaver.InvalidArgumentError, match="belongs to uid 65534 with mode 0777"):
            memsaver.set_disk_dir(d)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_another_user_can_neither_read_write_nor_plant_backups(hooks, tag, unset_disk_dir):
    _needs_root()
    # Reachable by others (0755 all the way): what keeps them out is the files' and the
    # directory's own modes, not a closed parent.
    base = Path(tempfile.mkdtemp(prefix="memsaver-other-user-"))
    try:
        os.chmod(base, 0o755)
        d = base / "backups"
        d.mkdir()
        os.chmod(d, 0o755)
        memsaver.set_disk_dir(d)
        with memsaver.region(tag, backup="disk"):
            p = hooks.malloc_ok(2 * MiB)
        data = pattern(2 * MiB, 3)
        write(p, data)
        memsaver.pause(tag)
        (name,) = os.listdir(d)
        f = d / name
        assert (f.stat().st_mode & 0o7777, f.stat().st_uid) == (0o600, 0)

        def attempts() -> int:
            tries: list[Callable[[], object]] = [
                lambda: open(f, "rb"),
                lambda: open(f, "r+b"),
                lambda: os.truncate(f, 0),
                lambda: open(d / "planted.bin", "xb"),
                lambda: os.symlink("/etc/passwd", d / name.replace(".bin", "0.bin")),
                lambda: os.rename(f, d / "moved.bin"),
            ]
            refused = 0
            for t in tries:
                try:
                    t()
                except PermissionError:
                    refused += 1
            return 0 if refused == len(tries) else 10 + refused

        assert as_nobody(attempts) == 0
        assert os.listdir(d) == [name], "nothing planted"
        memsaver.resume(tag)
        assert read(p, 2 * MiB) == data
        # Where another user can write, memsaver refuses the directory: nothing planted there
        # is ever used.
        open_dir = base / "open"
        open_dir.mkdir()
        os.chmod(open_dir, 0o777)

        def plant() -> int:
            os.symlink("/etc/passwd", open_dir / "memsaver-1-1-0000000000000001-0.bin")
            (open_dir / "planted.bin").write_bytes(b"theirs")
            return 0

        assert as_nobody(plant) == 0
        with pytest.raises(memsaver.InvalidArgumentError, match="mode 0777"):
            memsaver.set_disk_dir(open_dir)
        assert hooks.free(p) == CUDA_SUCCESS
        assert os.listdir(d) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_backup_changed_after_the_pause_fails_resume_and_stays_paused(hooks, tag, tmp_path, unset_disk_dir):
    d = tmp_path / "backups"
    memsaver.set_disk_dir(d)
    with memsaver.region(tag, backup="disk"):
        p = hooks.malloc_ok(2 * MiB)
    write(p, pattern(2 * MiB, 5))
    memsaver.pause(tag)
    (name,) = os.listdir(d)
    with open(d / name, "r+b") as f:  # other bytes, same size
        f.seek(MiB)
        f.write(b"\xff" * 4096)
    messages = []
    for _ in range(2):
        with pytest.raises(memsaver.IncompleteError) as e:
            memsaver.resume(tag)
        messages.append(str(e.value))
        assert memsaver.stats().tags[tag].paused
        assert memsaver.stats().tags[tag].resident_bytes == 0
    assert messages[0] == messages[1]
    m = messages[0]
    assert str(d / name) in m and f"tag '{tag}'" in m and "changed after the pause" in m, m
    assert "checksum" in m and "kept for inspection" in m, m
    assert os.listdir(d) == [name]
    assert hooks.free(p) == CUDA_SUCCESS
    assert os.listdir(d) == []


HOLDER = r"""
import os, sys
import memsaver
from memsaver import _memsaver

d = sys.argv[1]
memsaver.set_disk_dir(d)
assert memsaver.retain_backups()
p = _memsaver.malloc(4 << 20, 0, "held", "disk")
q = _memsaver.malloc(2 << 20, 0, "kept", "disk")
memsaver.pause("held")  # paused: its file holds the contents
memsaver.pause("kept")
memsaver.resume("kept")  # resumed, its file retained for the next pause
if len(sys.argv) > 2 and sys.argv[2] == "fork":
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a normal exit of a forked child: its exit handlers run
    os.waitpid(child, 0)
    print("forked child exited", flush=True)
# memsaver-<pidns>-<pid>-<start>-<nonce>-<n>.bin
print(" ".join(sorted(n for n in os.listdir(d) if n.split("-")[2] == str(os.getpid()))), flush=True)
sys.stdin.read()  # until the parent closes stdin (or kills this process)
"""


def _hold(
    env: dict[str, str], d: Path, *args: str, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], list[str]]:
    """A process holding two disk backup files in `d` (started through `prefix`, e.g. in
    another pid namespace); returns it and its files' names."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", HOLDER, str(d), *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if args == ("fork",):
        assert line.strip() == "forked child exited", line + proc.communicate()[1]
        line = proc.stdout.readline()
    names = line.split()
    assert len(names) == 2, line + (proc.communicate()[1] if not names else "")
    return proc, names


def _memsaver_cmd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memsaver", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_backup_files_go_at_a_clean_exit_with_retention_on_and_not_with_a_forked_child(child_env, tmp_path):
    d = tmp_path / "backups"
    proc, names = _hold(child_env, d, "fork")
    assert sorted(os.listdir(d)) == names, "a forked child's exit leaves its parent's files"
    _, err = proc.communicate("")
    assert proc.returncode == 0, err
    assert os.listdir(d) == [], "the exit handler removed the paused and the retained file"


def test_a_killed_process_leaves_files_that_the_next_user_of_the_directory_removes(child_env, tmp_path, unset_disk_dir):
    d = tmp_path / "backups"
    doomed, doomed_names = _hold(child_env, d)
    live, live_names = _hold(child_env, d)
    try:
        doomed.kill()
        doomed.communicate()
        assert sorted(os.listdir(d)) == sorted(doomed_names + live_names), "nobody removed them yet"

        # Diagnostics lists every file, whose and how big, and removes nothing.
        r = _memsaver_cmd("diagnostics", env=dict(child_env, MEMSAVER_DISK_DIR=str(d)))
        out = r.stdout
        assert f"{d}: this user's, not writable by others" in out, out
        assert "4 file(s), 12.0 MiB: 2 of running processes, 2 stale" in out, out
        for n in doomed_names:
            assert f"pid {doomed.pid} ({n}): " in out and "stale: its process is gone" in out, out
        for n in live_names:
            assert f"pid {live.pid} ({n}): " in out, out
        assert out.count(", running") == 2, out
        assert sorted(os.listdir(d)) == sorted(doomed_names + live_names)

        # The next process that opens the directory (this one) removes the dead one's files.
        memsaver.set_disk_dir(d)
        assert sorted(os.listdir(d)) == sorted(live_names), "a live process's files are never touched"
    finally:
        _, err = live.communicate("")
    assert live.returncode == 0, err
    assert os.listdir(d) == []


FULL_DISK = r"""
import ctypes, json, os, resource, signal, sys
import memsaver
from memsaver import _memsaver

d = sys.argv[1]
memsaver.set_disk_dir(d)
size = 4 << 20
ptrs = [_memsaver.malloc(size, 0, "full", "disk") for _ in range(2)]
for i, p in enumerate(ptrs):
    ctypes.memset(p, 0x30 + i, size)
# Every write past 1 MiB fails (EFBIG), as a full disk fails every write (ENOSPC).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
out = {}
try:
    memsaver.pause("full")
    out["pause"] = "ok"
except memsaver.MemsaverError as e:
    out["pause"] = f"{type(e).__name__}: {e}"
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
t = memsaver.stats().tags["full"]
out["paused"], out["resident"] = t.paused, t.resident_bytes
out["intact"] = all(ctypes.string_at(p, size) == bytes([0x30 + i]) * size for i, p in enumerate(ptrs))
out["files"] = os.listdir(d)
try:
    ptrs.append(_memsaver.malloc(size, 0, "full", "disk"))
    ctypes.memset(ptrs[-1], 0x32, size)
    out["malloc"] = "ok"
except memsaver.MemsaverError as e:
    out["malloc"] = f"{type(e).__name__}: {e}"
memsaver.pause("full")
memsaver.resume("full")
out["cycle"] = all(ctypes.string_at(p, size) == bytes([0x30 + i]) * size for i, p in enumerate(ptrs))
print(json.dumps(out))
"""


def test_a_pause_whose_every_disk_write_fails_leaves_the_tag_resident_and_usable(child_env, tmp_path):
    d = tmp_path / "backups"
    r = run_python(FULL_DISK, child_env, str(d))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["pause"].startswith("IncompleteError: ") and "File too large" in out["pause"], out
    assert "2 allocation(s)" in out["pause"], out
    assert (out["paused"], out["resident"], out["intact"]) == (False, 8 * MiB, True), out
    assert out["files"] == [], "the partial files are removed"
    assert out["malloc"] == "ok", out
    assert out["cycle"] is True, out


def test_files_of_another_pid_namespace_are_never_taken_for_stale(child_env, tmp_path, unset_disk_dir):
    """A container sharing the directory: its pids mean nothing here, so its files are never
    removed from here, even once its process is gone, and diagnostics says whose they are."""
    _needs_root()
    d = tmp_path / "backups"
    # --kill-child: killing unshare kills the namespace's first process (the holder, pid 1
    # there), without its exit handlers, as a crashed container leaves its files.
    prefix = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
    theirs, their_names = _hold(child_env, d, prefix=prefix)
    assert all(n.split("-")[2] == "1" for n in their_names), their_names
    theirs.kill()
    theirs.communicate()
    ours, our_names = _hold(child_env, d)
    ours.kill()
    ours.communicate()
    assert sorted(os.listdir(d)) == sorted(their_names + our_names)

    r = _memsaver_cmd("diagnostics", env=dict(child_env, MEMSAVER_DISK_DIR=str(d)))
    assert "4 file(s), 12.0 MiB: 0 of running processes, 2 stale, 2 of another pid namespace" in r.stdout, r.stdout
    assert r.stdout.count("another pid namespace's (a container sharing the directory)") == 2, r.stdout

    # Opening the directory removes this namespace's dead process's files, not the others'.
    memsaver.set_disk_dir(d)
    assert sorted(os.listdir(d)) == sorted(their_names)
    for n in their_names:
        os.unlink(d / n)
