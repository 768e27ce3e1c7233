"""The `memsaver` command (python -m memsaver, the console script's entry point) as a user runs
it: every subcommand and its help, profile checks that agree with load_profile, the core's
demo and bench, and diagnostics on the fake driver."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import memsaver
import pytest

BAD = sorted((pathlib.Path(__file__).parent / "profiles" / "bad").glob("*.yaml"))
EXAMPLE = pathlib.Path(__file__).parents[2] / "docs" / "examples" / "verl_grpo.yaml"
COMMANDS = [
    "demo",
    "check",
    "run",
    "pause",
    "resume",
    "stats",
    "timeline",
    "env",
    "preload-path",
    "bench",
    "options",
    "diagnostics",
]


def memsaver_cmd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memsaver", *args], capture_output=True, text=True, env=env)


def test_help_lists_every_command_with_a_line_of_help():
    r = memsaver_cmd("--help")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for c in COMMANDS:
        i = next((i for i, line in enumerate(lines) if line.split()[:1] == [c]), None)
        assert i is not None, f"{c} missing from:\n{r.stdout}"
        # the help is on the same line, or on the next one for long names
        assert len(lines[i].split()) > 1 or len(lines[i + 1].split()) > 1, r.stdout


def test_version():
    r = memsaver_cmd("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"memsaver {memsaver.__version__}"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(command):
    r = memsaver_cmd(command, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), command


def test_no_command_and_unknown_command_are_usage_errors():
    r = memsaver_cmd()
    assert r.returncode == 2 and "a command is required" in r.stderr
    r = memsaver_cmd("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_check_good_profile():
    r = memsaver_cmd("check", str(EXAMPLE))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{EXAMPLE}: ok (version 1; tags: cuda_graph, kv_cache, nccl, weights")


@pytest.mark.parametrize("path", BAD, ids=[p.name for p in BAD])
def test_check_and_load_profile_report_the_same_error(path):
    r = memsaver_cmd("check", str(path))
    assert r.returncode == 1
    with pytest.raises(memsaver.ProfileError) as e:
        memsaver.load_profile(str(path))
    assert r.stderr.strip() == str(e.value).strip()
    first = r.stderr.splitlines()[0]
    expected = path.read_text().splitlines()[0].removeprefix("# expect: ")
    assert first.startswith(f"{path.parent}/{expected}"), first
    assert ":0:" not in first


def test_unreadable_huge_and_binary_files_give_clear_errors(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"version: 1\nstages:\n  s\xff\xfe: []\n")
    missing = tmp_path / "missing.yaml"
    r = memsaver_cmd("check", "/dev/zero", str(binary), str(missing), str(tmp_path))
    assert r.returncode == 1
    err = r.stderr.splitlines()
    assert err[0] == (
        "/dev/zero:1:1048577: the file is larger than 1024 KiB, the most a profile may have; "
        "is it the right file?"
    )
    assert err[1].startswith(f"{binary}:3:4: not UTF-8 text (byte 0xff at offset 22)")
    assert err[2].startswith(f"{missing}: cannot read the profile: No such file or directory")
    assert err[3].startswith(f"{tmp_path}: cannot read the profile: Is a directory")
    assert "Traceback" not in r.stderr
    with pytest.raises(memsaver.ProfileError, match="larger than 1024 KiB"):
        memsaver.load_profile("/dev/zero")


def test_run_a_stage(child_env):
    r = memsaver_cmd("run", str(EXAMPLE), "sleep", env=child_env)
    assert r.returncode == 0, r.stderr
    assert "stage 'sleep'" in r.stdout and "pause kv_cache, cuda_graph" in r.stdout


def test_core_demo_and_bench_run_through_the_command(child_env):
    r = memsaver_cmd("demo", env=child_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wake 2: resume kv_cache+cuda_graph" in r.stdout and "verified bit-exact" in r.stdout
    r = memsaver_cmd(
        "bench", "--cpu-gib", "0.03125", "--discard-gib", "0.0625", "--cycles", "2", "--chunk-mib", "16",
        env=child_env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
    r = memsaver_cmd("bench", "--cyles", "2", env=child_env)
    assert r.returncode == 2 and "unknown option --cyles" in r.stderr
    r = memsaver_cmd("options", env=child_env)
    assert r.returncode == 0 and "`MEMSAVER_CUDA_LIB`" in r.stdout


def test_the_core_commands_and_flags_come_from_its_table(child_env):
    # One definition (torch-shim/src/cli/mod.rs, COMMANDS): `memsaver demo --help` shows the
    # core demo's flags from it, `memsaver --help` its commands, and a flag value the core
    # refuses is a usage error there as it was in argparse.
    import json

    from memsaver import _core, _memsaver

    _core.library()
    spec = json.loads(_memsaver.cli_spec())["commands"]
    assert [c["name"] for c in spec] == ["demo", "bench", "options"]
    demo_help = memsaver_cmd("demo", "--help").stdout
    for f in spec[0]["flags"]:
        assert f["name"] in demo_help and f["help"] in demo_help, demo_help
    top_help = memsaver_cmd("--help").stdout
    for c in spec[1:]:
        assert any(line.split()[:1] == [c["name"]] for line in top_help.splitlines()), top_help
    r = memsaver_cmd("demo", "--device", "x", env=child_env)
    assert r.returncode == 2 and "bad value for --device: x" in r.stderr, r.stderr


def test_profile_demo_writes_its_timeline(child_env, tmp_path):
    r = memsaver_cmd("demo", str(EXAMPLE), "-o", str(tmp_path), env=child_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "demo-timeline.html").is_file()


def test_diagnostics_on_the_fake_driver(child_env, tmp_path):
    child_env["MEMSAVER_RUNTIME_DIR"] = str(tmp_path / "rt")
    r = memsaver_cmd("diagnostics", env=child_env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for needle in (
        f"memsaver {memsaver.__version__}",
        "hook mode: inprocess",
        "loaded, fake driver (host memory)",
        "device 0:",
        f"MEMSAVER_CUDA_LIB={child_env['MEMSAVER_CUDA_LIB']}",
        f"{tmp_path / 'rt'}: not created yet",
        "group:        0",
        "owners:       none",
        '"owned_bytes": 0',
        "no problems found",
    ):
        assert needle in out, f"{needle!r} missing from:\n{out}"


def test_diagnostics_reports_every_problem_and_what_to_do(child_env, tmp_path):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o755)
    os.chmod(rt, 0o755)
    child_env["MEMSAVER_RUNTIME_DIR"] = str(rt)
    child_env["MEMSAVER_CUDA_LIB"] = str(tmp_path / "no-such-libcuda.so.1")
    r = memsaver_cmd("diagnostics", env=child_env)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert "driver:" in out and "PROBLEM" in out
    assert "mode 0755" in out and "needs it to belong to uid" in out
    assert "nccl_stats:" in out  # it went on past the problems
    assert "2 problem(s); what to do:" in out
    assert "set MEMSAVER_CUDA_LIB" in out and "set MEMSAVER_RUNTIME_DIR" in out


def test_diagnostics_lists_the_owners_of_the_group(child_env, tmp_path):
    # A group directory as a job leaves it: the socket names stand for a live process (this
    # test's own pid and start time) and a gone one; other entries are not owners.
    g = tmp_path / "rt" / "g0"
    g.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "rt", 0o700)
    os.chmod(g, 0o700)
    with open("/proc/self/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time, in clock ticks
    (g / f"{os.getpid()}-{start}-00000000000000aa.sock").touch()
    (g / "999999-1-00000000000000bb.sock").touch()
    (g / "not-a-socket-name").touch()
    child_env["MEMSAVER_RUNTIME_DIR"] = str(tmp_path / "rt")
    r = memsaver_cmd("diagnostics", env=child_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 process(es) serve this group" in r.stdout, r.stdout
    assert f"pid {os.getpid()} " in r.stdout and ": alive" in r.stdout, r.stdout
    assert "pid 999999 " in r.stdout and "gone (left its socket behind)" in r.stdout, r.stdout


def test_diagnostics_refuses_a_symlinked_runtime_dir(child_env, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    child_env["MEMSAVER_RUNTIME_DIR"] = str(tmp_path / "link")
    r = memsaver_cmd("diagnostics", env=child_env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "is a symbolic link" in r.stdout, r.stdout


def test_env_and_preload_path_fail_loudly_without_the_library(tmp_path):
    # A copy of the package without libmemsaver.so, as a broken installation would be.
    import shutil

    import memsaver as installed

    pkg = tmp_path / "memsaver"
    shutil.copytree(os.path.dirname(installed.__file__), pkg, ignore=shutil.ignore_patterns("libmemsaver.so"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for cmd in (["preload-path"], ["env"]):
        argv = [sys.executable, "-m", "memsaver", *cmd]
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, (cmd, r.stdout, r.stderr)
        assert "libmemsaver.so is missing" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert r.stdout == ""


def test_demo_fake_runs_on_the_fake_driver_shipped_in_the_wheel():
    # No driver named: `--fake` must find the wheel's own memsaver/_fake/libcuda.so.1.
    env = {k: v for k, v in os.environ.items() if k not in ("MEMSAVER_CUDA_LIB", "MEMSAVER_FAKE_CUDA_LIB")}
    bundled = pathlib.Path(memsaver.__file__).parent / "_fake" / "libcuda.so.1"
    assert bundled.is_file(), "the wheel carries the fake driver"
    r = subprocess.run(
        [sys.executable, "-m", "memsaver", "demo", "--fake"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
