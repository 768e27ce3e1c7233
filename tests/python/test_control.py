"""Control of other processes (memsaver.control, `memsaver pause/resume/stats/run --pid/--group`)
with real child processes on the fake driver: each child allocates tagged memory, serves
control requests and waits; the test drives it and checks its stats change."""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import memsaver
import pytest
from helpers import as_nobody
from memsaver import control

MIB = 1 << 20

CHILD = r"""
import os, sys, time
import memsaver
from memsaver import _memsaver

marker = sys.argv[1]
memsaver.stats()  # loads libmemsaver.so (MEMSAVER_CONTROL=1: serves once the allocator starts)
if os.environ.get("MEMSAVER_CONTROL") != "1":
    memsaver.serve_control()
_memsaver.malloc(8 << 20, 0, "weights", "cpu")
_memsaver.malloc(16 << 20, 0, "kv_cache", "discard")
if marker != "-":
    def sync_weights():
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
    memsaver.register_callback("sync_weights", sync_weights)
print("ready", flush=True)
time.sleep(120)
"""

PROFILE = """\
version: 1
tags:
  weights: {backup: cpu}
  kv_cache: {backup: discard}
stages:
  sleep:
    - pause: [kv_cache, weights]
  wake:
    - resume: [weights]
    - call: sync_weights
    - resume: [kv_cache]
"""


def _group() -> int:
    """A group no other test (or run) uses."""
    return random.randint(1_000_000, 2_000_000_000)


@pytest.fixture
def spawn(child_env, tmp_path) -> Iterator:
    """Starts children serving control; `spawn(group, callback_marker=None, env=...)` -> pid."""
    children: list[subprocess.Popen[str]] = []

    def start(group: int, marker: str | None = None, opt_in_env: bool = False) -> int:
        env = dict(child_env, MEMSAVER_GROUP=str(group))
        env.pop("MEMSAVER_CONTROL", None)
        if opt_in_env:
            env["MEMSAVER_CONTROL"] = "1"
        p = subprocess.Popen(
            [sys.executable, "-c", CHILD, marker or "-"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        children.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "ready", (line, p.stderr.read() if p.poll() is not None else "")
        return p.pid

    yield start
    for p in children:
        p.kill()
        p.wait()


def _resident(stats: memsaver.Stats, tag: str) -> int:
    return stats.tags[tag].resident_bytes


def test_pause_resume_and_stats_by_pid_and_by_group(spawn):
    g, other = _group(), _group()
    a, b = spawn(g), spawn(g, opt_in_env=True)  # serve_control() and MEMSAVER_CONTROL=1
    c = spawn(other)
    rollout = control.group(g)
    assert rollout.pids() == sorted([a, b])

    before = rollout.stats()
    assert set(before) == {a, b}
    assert all(_resident(s, "kv_cache") == 16 * MIB for s in before.values())

    assert rollout.pause("kv_cache") == sorted([a, b])
    after = rollout.stats()
    assert all(_resident(s, "kv_cache") == 0 and s.tags["kv_cache"].paused for s in after.values())
    assert all(_resident(s, "weights") == 8 * MIB for s in after.values())
    # The process of the other group was not reached.
    untouched = control.Target(c, group=other).stats()
    assert _resident(untouched, "kv_cache") == 16 * MIB

    # One process by pid: the others stay as they are.
    control.Target(a, group=g).resume("kv_cache")
    assert _resident(control.Target(a, group=g).stats(), "kv_cache") == 16 * MIB
    assert _resident(control.Target(b, group=g).stats(), "kv_cache") == 0
    rollout.resume()
    assert all(_resident(s, "kv_cache") == 16 * MIB for s in rollout.stats().values())


def test_the_group_is_named_never_guessed_and_errors_keep_their_type(spawn):
    g = _group()
    pid = spawn(g)
    # This process's group is another one: the request is refused, naming the group.
    with pytest.raises(memsaver.ControlError, match=f"process {pid} is in group {g}"):
        control.Target(pid).stats()
    with pytest.raises(memsaver.ControlError, match=f"no process of group {g + 1}"):
        control.group(g + 1).stats()
    # The target's own error, with its type.
    with pytest.raises(memsaver.UnknownTagError, match="unknown tag 'kv'; known tags"):
        control.Target(pid, group=g).pause("kv")
    with pytest.raises(memsaver.ControlError, match="is this process"):
        control.Target(os.getpid(), group=g).stats()


def test_run_calls_only_registered_callbacks_and_never_reports_a_skipped_call(spawn, tmp_path):
    g = _group()
    marker = tmp_path / "synced"
    with_cb = spawn(g, marker=str(marker))
    without = spawn(g)
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE)

    # sleep has no call steps: it runs in both.
    reports = control.group(g).run(profile, "sleep")
    assert set(reports) == {with_cb, without}
    assert all(not s.skipped for r in reports.values() for s in r.steps)

    # wake calls sync_weights: run where registered, refused (before any step) where not.
    with pytest.raises(memsaver.ControlError) as e:
        control.group(g).run(profile, "wake")
    msg = str(e.value)
    assert f"process {without}: stage 'wake' of {profile} calls sync_weights, which process {without}" in msg
    assert "did not register" in msg
    assert "no step was run" in msg
    answers = {a.pid: a for a in e.value.answers}  # type: ignore[attr-defined]
    assert answers[with_cb].ok and not answers[without].ok
    steps = answers[with_cb].result.steps
    assert [s.description for s in steps] == ["resume weights", "call sync_weights", "resume kv_cache"]
    assert not any(s.skipped for s in steps)
    assert marker.read_text().split() == [str(with_cb)]
    assert _resident(control.Target(with_cb, group=g).stats(), "weights") == 8 * MIB
    # Nothing ran in the other: still asleep.
    assert _resident(control.Target(without, group=g).stats(), "weights") == 0

    with pytest.raises(memsaver.ProfileStepError, match="did not register"):
        control.Target(without, group=g).run(profile, "wake")


def _memsaver_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memsaver", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_cli_pause_resume_stats_run(spawn, tmp_path, child_env):
    g = _group()
    a, b = spawn(g, marker=str(tmp_path / "m")), spawn(g)
    r = _memsaver_cli("pause", "--group", str(g), "kv_cache")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"process {p} (group {g}): paused kv_cache" for p in sorted([a, b])]
    r = _memsaver_cli("stats", "--pid", str(a), "--group", str(g), "--json")
    assert r.returncode == 0, r.stderr
    (answer,) = json.loads(r.stdout)
    assert answer["pid"] == a and answer["ok"]
    r = _memsaver_cli("pause", "--pid", str(a), "--group", str(g), "nope")
    assert r.returncode == 1 and "unknown tag 'nope'" in r.stderr
    r = _memsaver_cli("pause", "kv_cache")
    assert r.returncode == 2 and "--pid PID or --group G" in r.stderr

    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE)
    r = _memsaver_cli("run", str(profile), "wake", "--group", str(g))
    assert r.returncode == 1
    assert f"process {b} (group {g}): FAILED" in r.stderr and "did not register" in r.stderr
    assert f"process {a} (group {g}):\nstage 'wake'" in r.stdout
    r = _memsaver_cli("resume", "--group", str(g))
    assert r.returncode == 0 and "resumed every tag" in r.stdout

    # Without a target: this process, which holds nothing, and the call is reported skipped.
    r = _memsaver_cli("run", str(profile), "wake", env=child_env)
    assert r.returncode == 0, r.stderr
    assert "in this process (pid" in r.stderr and "holds no memory allocated through memsaver" in r.stderr
    assert "--pid PID or --group G" in r.stderr
    call = next(line for line in r.stdout.splitlines() if line.startswith("call sync_weights"))
    assert "skipped" in call
    assert "not run: call sync_weights" in r.stdout


def _raw_stats_request(sock: Path, group: int) -> bytes:
    """Sends a well-formed Stats request (kind 0x05) straight to the socket `sock`, claiming
    to be this process with start time 0; returns what comes back before EOF."""
    tpid, tstart, tnonce = sock.name.removesuffix(".sock").split("-")
    body = struct.pack("<BIQQIQQq", 0x05, os.getpid(), 0, 0, int(tpid), int(tstart), int(tnonce, 16), group)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(struct.pack("<I", len(body)) + body)
        out = b""
        while chunk := s.recv(4096):
            out += chunk
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid (os.setuid in a child)")
def test_a_request_from_another_uid_is_refused(spawn):
    g = _group()
    pid = spawn(g)
    memsaver.hook_mode()  # loads the library
    rt = Path(memsaver._memsaver.runtime_dir())
    gdir = rt / f"g{g}"
    (sock,) = gdir.glob("*.sock")

    # Through the API: the runtime directory is root's, mode 0700: refused, naming why.
    def through_api() -> int:
        try:
            control.Target(pid, group=g).stats()
        except memsaver.ControlError as e:
            return 0 if ("uid" in str(e) or "Permission denied" in str(e)) else 3
        return 4

    assert as_nobody(through_api) == 0

    # Straight to the socket, with the directories opened up: the server's SO_PEERCRED check
    # refuses another uid without a word, where the same uid gets an answer (a refusal: it
    # claimed start time 0).
    assert _raw_stats_request(sock, g)[4:5] == b"\x86"
    modes = rt.stat().st_mode, gdir.stat().st_mode
    # Directories above the runtime directory that the other uid cannot pass (a private test
    # directory holding it), opened for the test too.
    closed = [(d, d.stat().st_mode) for d in rt.parents if not d.stat().st_mode & 0o001]
    try:
        for d, mode in closed:
            os.chmod(d, mode | 0o001)
        os.chmod(rt, 0o711)
        os.chmod(gdir, 0o711)
        os.chmod(sock, 0o777)

        def raw() -> int:
            try:
                return 0 if _raw_stats_request(sock, g) == b"" else 5
            except (BrokenPipeError, ConnectionResetError):  # closed before the request was read
                return 0

        assert as_nobody(raw) == 0
    finally:
        os.chmod(rt, modes[0] & 0o7777)
        os.chmod(gdir, modes[1] & 0o7777)
        for d, mode in closed:
            os.chmod(d, mode & 0o7777)
    assert _resident(control.Target(pid, group=g).stats(), "kv_cache") == 16 * MIB


def test_ray_runtime_env_passes_the_preload_group_and_settings():
    env = memsaver.ray_runtime_env(
        group=200,
        env_vars={"EXTRA": "1"},
        environ={"MEMSAVER_RUNTIME_DIR": "/r", "MEMSAVER_HOOK_MODE": "auto", "OTHER": "x", "LD_PRELOAD": "a.so"},
    )["env_vars"]
    assert env["LD_PRELOAD"].split(":") == [memsaver.preload_path(), "a.so"]
    assert env["MEMSAVER_HOOK_MODE"] == "preload"
    assert env["MEMSAVER_GROUP"] == "200" and env["MEMSAVER_CONTROL"] == "1"
    assert env["MEMSAVER_RUNTIME_DIR"] == "/r" and env["EXTRA"] == "1" and "OTHER" not in env
    assert memsaver.ray_runtime_env(group=1, control=False)["env_vars"]["MEMSAVER_CONTROL"] == "0"
    with pytest.raises(TypeError):
        memsaver.ray_runtime_env(group="200")  # type: ignore[arg-type]


def test_a_process_answers_while_busy_and_stays_reachable(spawn):
    """Several requests at once: each answered (the control thread serialises them). Three
    clients keep at most three requests waiting, below the queue's eight: none is refused."""
    g = _group()
    pid = spawn(g)
    t = control.Target(pid, group=g)
    import threading

    errors: list[BaseException] = []
    done: list[int] = []

    def cycle() -> None:
        try:
            for _ in range(5):
                t.pause("kv_cache")
                t.resume("kv_cache")
                done.append(1)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=cycle) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads), "a request got no answer"
    assert errors == [] and len(done) == 15, (errors, len(done))
    # Every client's last request was a resume, so the last one served was too.
    assert _resident(t.stats(), "kv_cache") == 16 * MIB


def test_status_codes_round_trip_through_the_binding():
    # The one mapping lives in the binding (generated from the C ABI): every exception class
    # maps to a status and back to the same class, subclasses before their bases.
    from memsaver import _memsaver

    for name in ("InvalidArgumentError", "UnknownTagError", "ResumeOutOfMemoryError", "OutOfMemoryError",
                 "PeerError", "ProfileError", "BackupError", "ControlError", "PauseRefusedError",
                 "DriverNotLoadedError"):
        cls = getattr(memsaver, name)
        code = _memsaver.status_of(cls("x"))
        err = _memsaver.error_from_status(code, "msg")
        assert type(err) is cls and str(err) == "msg", (name, code, err)
    assert _memsaver.status_of(ValueError("x")) == 99
