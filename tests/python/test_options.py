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
