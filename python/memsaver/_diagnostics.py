"""``memsaver diagnostics``: what this installation sees, going on past every problem.

Prints the version, the library and its hook mode, the CUDA driver (real or fake) or why it did
not load, the devices with free and total memory, the ``MEMSAVER_*`` variables that are set,
the runtime directory of the ``nccl`` tag's sockets, its group and the processes that serve
it, ``nccl_stats()``, and the disk backup directory with the backup files left in it (whose,
how big, running or stale). Each problem found
adds a line saying what to do; the exit status is 1 if there was any.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any


class _Report:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def line(self, key: str, value: str) -> None:
        print(f"{key + ':':<14}{value}")

    def problem(self, key: str, what: str, todo: str) -> None:
        self.line(key, f"PROBLEM: {what}")
        self.problems.append(f"{key}: {todo}")


def _driver_kind(path: str) -> str:
    """"fake" for tests/fake-cuda's libcuda.so.1, else "real" (or why it cannot be opened)."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return f"cannot be opened: {e}"
    return "fake driver (host memory)" if hasattr(lib, "fakecuda_reset_faults") else "real driver"


def _device_count(path: str) -> int:
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return 0  # memsaver.device_memory says why
    n = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value


def _nccl_coordination(r: _Report, d: dict[str, Any]) -> None:
    """The runtime directory, the group's directory and its owners, as libmemsaver.so checks
    them (the rules live there: docs/security.md)."""
    advice = "set MEMSAVER_RUNTIME_DIR to a directory of your own, or fix the entry named"
    for key, path, found in (
        ("runtime dir", d["runtime_dir"], d["runtime_dir_state"]),
        ("group dir", f"{d['runtime_dir']}/g{d['group']}", d["group_dir_state"]),
    ):
        if found["state"] == "problem":
            r.problem(key, found["detail"], advice)
        elif found["state"] == "missing":
            r.line(key, f"{path}: not created yet (mode 0700, when NCCL memory is first shared)")
        else:
            r.line(key, f"{path}: private to this user")
    r.line("group", str(d["group"]))
    owners = d["owners"]
    r.line("owners", "none" if not owners else f"{len(owners)} process(es) serve this group")
    for name, pid, alive in owners:
        r.line("", f"pid {pid} ({name}): {'alive' if alive else 'gone (left its socket behind)'}")
    if d["fallback_reason"]:
        r.problem(
            "exports",
            d["fallback_reason"],
            "fix the runtime directory (above), then restart the job: pause('nccl') cannot free its memory",
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _disk_backups(r: _Report, d: dict[str, Any]) -> None:
    """The disk backup directory as a pause would find it, and the backup files in it (the
    rules live in libmemsaver.so: docs/security.md, "Backup files")."""
    if d["dir"] is None:
        r.line("disk dir", "not set (backup='disk' needs MEMSAVER_DISK_DIR or memsaver.set_disk_dir)")
        return
    state = d["state"]
    if state["state"] == "problem":
        r.problem("disk dir", state["detail"], "use a disk backup directory of your own that others cannot write")
        return
    if state["state"] == "missing":
        r.line("disk dir", f"{d['dir']}: not created yet (mode 0700, at the first disk pause)")
        return
    r.line("disk dir", f"{d['dir']}: this user's, not writable by others")
    files = d["files"]
    stale = [f for f in files if not f["running"] and not f.get("other_namespace")]
    other = [f for f in files if f.get("other_namespace")]
    total = sum(f["bytes"] for f in files)
    r.line(
        "disk backups",
        "none"
        if not files
        else f"{len(files)} file(s), {_mib(total)}: {len(files) - len(stale) - len(other)} of running "
        f"processes, {len(stale)} stale" + (f", {len(other)} of another pid namespace" if other else ""),
    )
    for f in files:
        if f["own"]:
            whose = "this process"
        elif f["running"]:
            whose = "running"
        elif f.get("other_namespace"):
            whose = "another pid namespace's (a container sharing the directory): never removed from here"
        else:
            whose = "stale: its process is gone; the next process that opens the directory removes it"
        r.line("", f"pid {f['pid']} ({f['name']}): {_mib(f['bytes'])}, {whose}")


def main() -> int:
    import memsaver
    from memsaver import _core, _memsaver

    r = _Report()
    r.line("version", f"memsaver {memsaver.__version__} (Python {sys.version.split()[0]}, {sys.executable})")

    loaded = False
    try:
        mode, path = _core.ensure_loaded()
        r.line("library", f"{path} (hook mode: {mode})")
        loaded = True
    except memsaver.MemsaverError as e:
        r.problem(
            "library", str(e), "reinstall memsaver (pip install --force-reinstall memsaver) or fix the mode above"
        )

    driver = os.environ.get("MEMSAVER_CUDA_LIB") or "libcuda.so.1"
    kind = _driver_kind(driver)
    devices = 0
    driver_ok = False
    if loaded:
        try:
            devices = _device_count(driver)
            memsaver.device_memory(0)
            driver_ok = True
            r.line("driver", f"{driver}: loaded, {kind}")
        except memsaver.MemsaverError as e:
            what = f"{driver}: not usable: {e}" if kind.startswith("cannot") else f"{driver} ({kind}): not usable: {e}"
            r.problem("driver", what,
                      "install the NVIDIA driver, or set MEMSAVER_CUDA_LIB to libcuda.so.1's path "
                      "(the fake driver for tests: target/fake-cuda/libcuda.so.1)")
    if driver_ok and devices:
        r.line("devices", str(devices))
        for d in range(devices):
            try:
                free, total = memsaver.device_memory(d)
                r.line(f"  device {d}", f"{free / (1 << 30):.2f} GiB free of {total / (1 << 30):.2f} GiB")
            except memsaver.MemsaverError as e:
                r.problem(f"  device {d}", str(e), "check the device with nvidia-smi")
    elif driver_ok:
        r.problem("devices", "none", "check CUDA_VISIBLE_DEVICES and nvidia-smi")

    names = sorted(k for k in os.environ if k.startswith("MEMSAVER_"))
    r.line("variables", "none set" if not names else names[0] + "=" + os.environ[names[0]])
    for k in names[1:]:
        r.line("", f"{k}={os.environ[k]}")

    if loaded:
        try:
            _nccl_coordination(r, json.loads(_memsaver.nccl_diagnose_json()))
        except memsaver.MemsaverError as e:
            r.problem("runtime dir", str(e), "set MEMSAVER_RUNTIME_DIR to a private directory")
        try:
            _disk_backups(r, json.loads(_memsaver.disk_diagnose_json()))
        except memsaver.MemsaverError as e:
            r.problem("disk dir", str(e), "run with MEMSAVER_LOG=debug and report it")
        try:
            r.line("nccl_stats", json.dumps(memsaver.nccl_stats(), sort_keys=True))
        except memsaver.MemsaverError as e:
            r.problem("nccl_stats", str(e), "run with MEMSAVER_LOG=debug and report it")

    if r.problems:
        print(f"\n{len(r.problems)} problem(s); what to do:")
        for p in r.problems:
            print(f"  {p}")
        return 1
    print("\nno problems found")
    return 0
