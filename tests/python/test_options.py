"""Options are strict: an invalid value is an error naming the variable and the accepted values
(docs/options.md), raised by the first memsaver call, never a default taken in silence. Each
case runs in a child process: libmemsaver.so reads its options once per process."""

from __future__ import annotations

from helpers import run_python

_STATS = """
import memsaver
try:
    memsaver.stats()
except memsaver.MemsaverError as e:
    print("error:", e)
else:
    print("no error")
"""


def test_an_invalid_library_option_fails_the_first_call_naming_it(child_env):
    env = dict(child_env, MEMSAVER_NCCL_TOKENS="maybe", MEMSAVER_NCCL_TIMEOUT_MS="soon")
    r = run_python(_STATS, env)
    assert r.returncode == 0, r.stderr
    assert "error:" in r.stdout, r.stdout
    assert "MEMSAVER_NCCL_TOKENS='maybe': expected 0 or 1" in r.stdout, r.stdout
    assert "MEMSAVER_NCCL_TIMEOUT_MS='soon': expected a whole number from 1 to 86400000 (ms)" in r.stdout


def test_python_stats_command_surfaces_invalid_options(child_env):
    env = dict(child_env, MEMSAVER_RETAIN_BACKUP="sometimes")
    r = run_python("", env, "-m", "memsaver", "stats")
    assert r.returncode != 0
    assert "MEMSAVER_RETAIN_BACKUP='sometimes': expected 0 or 1" in r.stdout + r.stderr


def test_an_invalid_log_filter_warns_and_the_calls_work(child_env):
    env = dict(child_env, MEMSAVER_LOG="memsaver=loud")
    r = run_python(_STATS, env)
    assert "no error" in r.stdout, r.stdout + r.stderr
    assert "MEMSAVER_LOG='memsaver=loud'" in r.stderr, r.stderr


def test_an_invalid_alias_switch_warns_and_stays_off(child_env):
    env = dict(child_env, MEMSAVER_TORCH_MEMORY_SAVER="yes")
    r = run_python("import torch_memory_saver", env)
    assert "MEMSAVER_TORCH_MEMORY_SAVER='yes': expected 0 or 1" in r.stderr, r.stderr
    assert "No module named 'torch_memory_saver'" in r.stderr


_STATS_AND_SERVE = """
import memsaver
for call in (memsaver.stats, memsaver.serve_control):
    try:
        call()
    except memsaver.MemsaverError as e:
        print(f"{call.__name__}: {type(e).__name__}: {e}")
    else:
        print(f"{call.__name__}: no error")
"""


def test_control_that_cannot_be_served_fails_at_start(child_env, tmp_path):
    """MEMSAVER_CONTROL=1 in a process whose runtime directory is not private: the first
    memsaver call fails, naming the directory and what to do, as an invalid option does, and
    serve_control() says the same. (Before: one warning, and the process ran without control.)"""
    rt = tmp_path / "shared"
    rt.mkdir()
    rt.chmod(0o755)
    env = dict(child_env, MEMSAVER_CONTROL="1", MEMSAVER_RUNTIME_DIR=str(rt))
    r = run_python(_STATS_AND_SERVE, env)
    assert r.returncode == 0, r.stderr
    said = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    stats = said["stats"]
    assert stats.startswith("InvalidArgumentError: ") and (
        "MEMSAVER_CONTROL=1 is set, but this process cannot serve control requests" in stats
    ), stats
    assert str(rt) in stats and "mode 0755" in stats and "set MEMSAVER_RUNTIME_DIR" in stats, stats
    assert "unset MEMSAVER_CONTROL" in stats, stats
    serve = said["serve_control"]
    assert serve.startswith("ControlError: cannot serve control requests") and str(rt) in serve, serve


_STATS_NAMED = """
import memsaver
try:
    memsaver.stats()
except memsaver.MemsaverError as e:
    print(f"{type(e).__name__}: {e}")
else:
    print("no error")
"""


def test_a_whole_process_backup_is_checked_with_the_tag_unset(child_env):
    """MEMSAVER_PROCESS_BACKUP=zip in a process where whole-process mode is off (no
    MEMSAVER_PROCESS_TAG, no TMS_INIT_ENABLE): the first call fails naming the variable, its
    value and the accepted policies. (Before: accepted in silence while the tag was unset.)"""
    env = {k: v for k, v in child_env.items() if not k.startswith(("MEMSAVER_PROCESS_", "TMS_"))}
    env["MEMSAVER_PROCESS_BACKUP"] = "zip"
    r = run_python(_STATS_NAMED, env)
    assert r.returncode == 0, r.stderr
    said = r.stdout.strip()
    assert said.startswith("InvalidArgumentError: "), said + r.stderr
    assert "MEMSAVER_PROCESS_BACKUP='zip': expected discard, cpu, mmap or disk" in said, said
    # The same environment with a valid policy works: the tag being unset is not the error.
    env["MEMSAVER_PROCESS_BACKUP"] = "cpu"
    r = run_python(_STATS_NAMED, env)
    assert r.stdout.strip() == "no error", r.stdout + r.stderr
