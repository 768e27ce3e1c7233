"""Scenarios that need a process of their own: preload mode (one process, one allocator state),
fault injection, the launch helpers and `python -m memsaver`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import memsaver
import pytest
from helpers import MiB, run_python

PRELOADED_PROCESS = r"""
import ctypes, json, os
import memsaver
from memsaver import _memsaver

out = {"mode": memsaver.hook_mode(), "path": _memsaver.loaded()[1]}
# The preloaded copy, found through the global scope as any other library would find it.
lib = ctypes.CDLL(None)
lib.memsaver_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_char_p, ctypes.c_char_p]
p = ctypes.c_void_p()
assert lib.memsaver_malloc(ctypes.byref(p), 2 << 20, 0, b"from_c", b"cpu") == 0
out["from_c"] = memsaver.stats().tags["from_c"].allocations
# The interposed cudaMalloc of the global scope (what libc10_cuda calls) sees the region
# entered through the extension.
lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
q = ctypes.c_void_p()
with memsaver.region("hooked"):
    out["cudaMalloc"] = lib.cudaMalloc(ctypes.byref(q), 4 << 20)
out["hooked"] = memsaver.stats().tags["hooked"].reserved_bytes
memsaver.pause()
out["resident_after_pause"] = memsaver.stats().total.resident_bytes
memsaver.resume()
print(json.dumps(out))
"""


def test_preload_mode_shares_one_state(child_env):
    env = dict(child_env, LD_PRELOAD=memsaver.preload_path(), MEMSAVER_HOOK_MODE="preload")
    r = run_python(PRELOADED_PROCESS, env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "preload"
    assert os.path.realpath(out["path"]) == os.path.realpath(memsaver.preload_path())
    assert out["from_c"] == 1
    assert out["cudaMalloc"] == 0
    assert out["hooked"] == 4 << 20
    assert out["resident_after_pause"] == 0


def test_plain_process_is_inprocess(child_env):
    r = run_python("import memsaver; print(memsaver.hook_mode())", child_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "inprocess"


def test_hook_mode_preload_without_preload_fails_with_instructions(child_env):
    env = dict(child_env, MEMSAVER_HOOK_MODE="preload")
    r = run_python("import memsaver; memsaver.pause()", env)
    assert r.returncode != 0
    assert "MemsaverError" in r.stderr
    assert f"LD_PRELOAD={memsaver.preload_path()} python ..." in r.stderr
    assert "python -m memsaver env" in r.stderr


RESUME_OOM = r"""
import ctypes
import memsaver
from memsaver import _memsaver

memsaver.hook_mode()
a = _memsaver.malloc(2 << 20, 0, "w", "cpu")   # cuMemCreate 1
b = _memsaver.malloc(2 << 20, 0, "w", "cpu")   # cuMemCreate 2
ctypes.memmove(a, b"A" * 16, 16)
memsaver.pause("w")
try:
    memsaver.resume("w")                        # cuMemCreate 3 fails
except memsaver.OutOfMemoryError as e:
    assert type(e) is memsaver.ResumeOutOfMemoryError, type(e)
    assert "call resume again" in str(e), str(e)
    t = memsaver.stats().tags["w"]
    assert t.allocations == 2 and t.reserved_bytes == 4 << 20, t
    assert t.backup_bytes == 4 << 20, t          # nothing lost
else:
    raise SystemExit("resume did not fail")
memsaver.resume("w")
t = memsaver.stats().tags["w"]
assert not t.paused and t.resident_bytes == 4 << 20, t
assert ctypes.string_at(a, 16) == b"A" * 16
print("ok")
"""


def test_resume_out_of_memory_is_an_error_and_resume_again_works(child_env):
    # One physical allocation per allocation, so that the third create is the third one.
    env = dict(child_env, FAKE_CUDA_FAIL_CREATE_AT="3", MEMSAVER_MERGE_MB="0")
    r = run_python(RESUME_OOM, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok"


def test_configure_subprocess_sets_and_restores_environment(monkeypatch):
    path = memsaver.preload_path()
    monkeypatch.setenv("LD_PRELOAD", "/opt/a.so /opt/b.so")
    monkeypatch.delenv("MEMSAVER_HOOK_MODE", raising=False)
    monkeypatch.setenv("MEMSAVER_CUDA_LIB", "/opt/libcuda.so.1")
    with memsaver.configure_subprocess() as env:
        assert os.environ["LD_PRELOAD"] == f"{path}:/opt/a.so:/opt/b.so"
        assert os.environ["MEMSAVER_HOOK_MODE"] == "preload"
        assert os.environ["MEMSAVER_CUDA_LIB"] == "/opt/libcuda.so.1"
        assert env["LD_PRELOAD"] == os.environ["LD_PRELOAD"]
        assert env["MEMSAVER_CUDA_LIB"] == "/opt/libcuda.so.1"
        # Nested use does not duplicate the library.
        with memsaver.configure_subprocess():
            assert os.environ["LD_PRELOAD"] == f"{path}:/opt/a.so:/opt/b.so"
    assert os.environ["LD_PRELOAD"] == "/opt/a.so /opt/b.so"
    assert "MEMSAVER_HOOK_MODE" not in os.environ
    assert os.environ["MEMSAVER_CUDA_LIB"] == "/opt/libcuda.so.1"


def test_configure_subprocess_restores_on_error(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.raises(RuntimeError):
        with memsaver.configure_subprocess():
            assert os.environ["LD_PRELOAD"] == memsaver.preload_path()
            raise RuntimeError
    assert "LD_PRELOAD" not in os.environ


def test_subprocess_env_passes_through_memsaver_settings():
    env = memsaver.subprocess_env({"LD_PRELOAD": memsaver.preload_path(), "MEMSAVER_LOG": "debug"})
    assert env == {
        "LD_PRELOAD": memsaver.preload_path(),
        "MEMSAVER_HOOK_MODE": "preload",
        "MEMSAVER_LOG": "debug",
    }


def test_configure_subprocess_child_runs_in_preload_mode(child_env, monkeypatch):
    for k, v in child_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with memsaver.configure_subprocess():
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                "import memsaver; memsaver.stats(); print(memsaver.hook_mode())",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "preload"


def test_cli_env_is_evalable_and_preloads(child_env):
    r = run_python("", child_env, "-m", "memsaver", "env")
    assert r.returncode == 0, r.stderr
    path = memsaver.preload_path()
    assert f"export LD_PRELOAD={path}" in r.stdout
    assert "export MEMSAVER_HOOK_MODE=preload" in r.stdout
    assert f"export MEMSAVER_CUDA_LIB={child_env['MEMSAVER_CUDA_LIB']}" in r.stdout
    assert "torchrun" in r.stdout
    assert 'runtime_env={"env_vars": {"LD_PRELOAD": ' in r.stdout
    script = (
        f'eval "$({sys.executable} -m memsaver env)"; '
        f'{sys.executable} -c "import memsaver; memsaver.stats(); print(memsaver.hook_mode())"'
    )
    r = subprocess.run(
        ["bash", "-c", script], env=child_env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "preload"


def test_cli_env_json_preload_path_and_stats(child_env):
    env = dict(child_env, MEMSAVER_LOG="warn")
    r = run_python("", env, "-m", "memsaver", "env", "--json")
    assert r.returncode == 0, r.stderr
    # Written out: the library, preload mode, and the settings children must share (the driver
    # and the log filter).
    assert json.loads(r.stdout) == {
        "LD_PRELOAD": memsaver.preload_path(),
        "MEMSAVER_HOOK_MODE": "preload",
        "MEMSAVER_CUDA_LIB": child_env["MEMSAVER_CUDA_LIB"],
        "MEMSAVER_LOG": "warn",
    }
    r = run_python("", child_env, "-m", "memsaver", "preload-path")
    assert (r.returncode, r.stdout.strip()) == (0, memsaver.preload_path())
    r = run_python("", child_env, "-m", "memsaver", "stats")
    assert r.returncode == 0, r.stderr
    assert "hook mode: inprocess" in r.stdout and "total" in r.stdout


def test_cli_unknown_or_missing_command_exits_2(child_env):
    r = run_python("", child_env, "-m", "memsaver", "frobnicate")
    assert r.returncode == 2
    assert "invalid choice: 'frobnicate'" in r.stderr and "env" in r.stderr
    r = run_python("", child_env, "-m", "memsaver")
    assert r.returncode == 2
    assert "a command is required" in r.stderr


NCCL_HOOKED = r"""
import ctypes, json, os, sys
import memsaver

class FakeNcclAlloc(ctypes.Structure):  # tests/fake-nccl: what one allocation did
    _fields_ = [("get_proc_address", ctypes.c_size_t), ("mem_create", ctypes.c_size_t),
                ("handle", ctypes.c_uint64), ("ptr", ctypes.c_uint64), ("size", ctypes.c_size_t),
                ("exported_fd", ctypes.c_int)]

nccl = ctypes.CDLL(sys.argv[1])
nccl.fake_nccl_alloc.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(FakeNcclAlloc)]
nccl.fake_nccl_free.argtypes = [ctypes.c_char_p, ctypes.POINTER(FakeNcclAlloc)]
cuda = os.environ["MEMSAVER_CUDA_LIB"].encode()
out = {"before": memsaver.nccl_stats()}
shared, private = FakeNcclAlloc(), FakeNcclAlloc()
assert nccl.fake_nccl_alloc(cuda, 4 << 20, 1, ctypes.byref(shared)) == 0   # exported, as for peers
assert nccl.fake_nccl_alloc(cuda, 6 << 20, 0, ctypes.byref(private)) == 0
ctypes.memset(private.ptr, 0x5A, 6 << 20)   # the fake driver's device memory is host memory
out["allocated"] = memsaver.nccl_stats()
out["free_allocated"] = memsaver.device_memory(0)[0]
memsaver.pause("nccl")
out["paused"] = memsaver.nccl_stats()
out["tag_paused"] = memsaver.stats().tags["nccl"].paused
out["free_paused"] = memsaver.device_memory(0)[0]
memsaver.resume("nccl")
out["resumed"] = memsaver.nccl_stats()
out["free_resumed"] = memsaver.device_memory(0)[0]
out["contents_kept"] = ctypes.string_at(private.ptr, 6 << 20) == b"\x5a" * (6 << 20)
assert nccl.fake_nccl_free(cuda, ctypes.byref(shared)) == 0
assert nccl.fake_nccl_free(cuda, ctypes.byref(private)) == 0
out["freed"] = memsaver.nccl_stats()
print(json.dumps(out))
"""


@pytest.fixture
def fake_nccl() -> str:
    """The libnccl.so.2 stand-in (tests/fake-nccl; `make fake-cuda` builds it)."""
    path = os.environ.get("MEMSAVER_FAKE_NCCL_LIB") or os.path.join(
        os.path.dirname(os.environ["MEMSAVER_CUDA_LIB"]), "..", "fake-nccl", "libnccl.so.2"
    )
    if not os.path.exists(path):
        pytest.skip(f"no fake NCCL at {path}: build it with `make fake-cuda`")
    return path


def test_nccl_stats_while_hooked(child_env, fake_nccl):
    """nccl_stats() from Python in a preloaded process whose NCCL (the stand-in) allocates
    through the hook: the figures are those of what NCCL allocated, and pausing `nccl` gives
    its device memory back."""
    env = dict(child_env, LD_PRELOAD=memsaver.preload_path(), MEMSAVER_HOOK_MODE="preload")
    r = run_python(NCCL_HOOKED, env, fake_nccl)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    b = out["before"]
    assert (b["hooked"], b["owned_bytes"], b["cumem_disabled"]) == (False, 0, False), "NCCL resolved nothing yet"
    a = out["allocated"]
    assert (a["hooked"], a["paused"], a["paused_bytes"]) == (True, False, 0)
    assert (a["owned_bytes"], a["owned_handles"], a["mappings"]) == (10 * MiB, 2, 2)
    assert (a["exported_handles"], a["exported_bytes"], a["imported_bytes"]) == (1, 4 * MiB, 0)
    p = out["paused"]
    assert p["paused"] is True and out["tag_paused"] is True
    assert p["paused_bytes"] == 10 * MiB and p["resident_pinned_bytes"] == 0
    assert out["free_paused"] - out["free_allocated"] == 10 * MiB, "the device got all of it back"
    assert (out["resumed"]["paused"], out["resumed"]["paused_bytes"]) == (False, 0)
    assert out["free_resumed"] == out["free_allocated"]
    assert out["contents_kept"]
    f = out["freed"]
    assert (f["owned_bytes"], f["owned_handles"], f["mappings"], f["exported_handles"]) == (0, 0, 0, 0)


NCCL_MEM_ALLOC = r"""
import ctypes, json, os, sys
import memsaver

nccl = ctypes.CDLL(sys.argv[1])       # as vLLM's pynccl and the issue's users do
nccl.fake_nccl_set_cuda_lib(os.environ["MEMSAVER_CUDA_LIB"].encode())
nccl.ncclMemAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
nccl.ncclMemFree.argtypes = [ctypes.c_void_p]
ctx = ctypes.c_void_p()   # the fake NCCL allocates on the current device, as NCCL does
cuda = ctypes.CDLL(os.environ["MEMSAVER_CUDA_LIB"])
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0

def alloc(n):
    p = ctypes.c_void_p()
    assert nccl.ncclMemAlloc(ctypes.byref(p), n) == 0
    return p.value

plain = alloc(2 << 20)
with memsaver.region("weights", backup="cpu"):
    tagged = alloc(4 << 20)
ctypes.memset(plain, 0x11, 2 << 20)
ctypes.memset(tagged, 0x5A, 4 << 20)
out = {"allocated": memsaver.nccl_stats()["application"],
       "free0": memsaver.device_memory(0)[0]}
memsaver.pause("weights", "nccl")
out["freed"] = memsaver.device_memory(0)[0] - out["free0"]
out["plain_while_paused"] = ctypes.string_at(plain, 2 << 20) == b"\x11" * (2 << 20)
memsaver.resume("nccl", "weights")
out["tagged_kept"] = ctypes.string_at(tagged, 4 << 20) == b"\x5a" * (4 << 20)
assert nccl.ncclMemFree(plain) == 0 and nccl.ncclMemFree(tagged) == 0
out["after_free"] = memsaver.nccl_stats()["application"]
print(json.dumps(out))
"""


def test_memory_from_ncclmemalloc_takes_the_region_tag(child_env, fake_nccl):
    """ncclMemAlloc looked up in libnccl's handle with ctypes: inside a region the memory is
    the region tag's (freed by its pause, every byte back after its resume), outside it stays
    resident; nccl_stats() shows it apart from NCCL's own memory."""
    env = dict(child_env, LD_PRELOAD=memsaver.preload_path(), MEMSAVER_HOOK_MODE="preload")
    r = run_python(NCCL_MEM_ALLOC, env, fake_nccl)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["allocated"] == {
        "allocations": 2, "bytes": 6 * MiB, "tagged_bytes": {"weights": 4 * MiB},
        "untagged_bytes": 2 * MiB,
    }
    assert out["freed"] == 4 * MiB, "the tagged buffer, not the untagged one"
    assert out["plain_while_paused"] and out["tagged_kept"]
    assert out["after_free"]["allocations"] == 0


DEVICE_MEMORY = r"""
import json
import memsaver
from memsaver import _memsaver

out = {"start": [memsaver.device_memory(d) for d in (0, 1)]}
w = _memsaver.malloc(3 << 20, 0, "w", "cpu")          # 4 MiB of device 0 (2 MiB granularity)
kv = _memsaver.malloc(6 << 20, 1, "kv", "discard")    # 6 MiB of device 1
out["allocated"] = [memsaver.device_memory(d) for d in (0, 1)]
memsaver.pause("w")
out["w_paused"] = [memsaver.device_memory(d) for d in (0, 1)]
memsaver.resume("w")
_memsaver.free(kv)
out["kv_freed"] = [memsaver.device_memory(d) for d in (0, 1)]
try:
    memsaver.device_memory(2)
except memsaver.MemsaverError as e:
    out["device_2"] = type(e).__name__
print(json.dumps(out))
"""


def test_device_memory_is_what_the_driver_has_and_what_was_allocated(child_env):
    # A machine of two 1 GiB devices of its own (child_env: its own fake-driver state).
    env = dict(child_env, FAKE_CUDA_MEM_BYTES="1GiB", FAKE_CUDA_DEVICES="2")
    r = run_python(DEVICE_MEMORY, env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    G = 1 << 30
    assert out["start"] == [[G, G], [G, G]]
    assert out["allocated"] == [[G - 4 * MiB, G], [G - 6 * MiB, G]]
    assert out["w_paused"] == [[G, G], [G - 6 * MiB, G]]
    assert out["kv_freed"] == [[G - 4 * MiB, G], [G, G]]
    assert out["device_2"] == "InvalidArgumentError"


PREPARE_LIMIT = r"""
import json
import memsaver
from memsaver import _memsaver

def requested(tag):
    # Whether a pinned backup was asked for `tag`'s allocation: it is being prepared or it is
    # ready. Read twice: the first snapshot may read the prepared bytes just before the thread
    # finishes and the pending count just after; the second then sees the bytes (nothing takes
    # them: no pause, no free). Only this process's allocations are counted.
    a, b = memsaver.stats(), memsaver.stats()
    return bool(a.tags[tag].prepared_backup_bytes or a.backups_preparing or b.tags[tag].prepared_backup_bytes)

out = {}
memsaver.set_backup_prepare_limit(0)
_memsaver.malloc(4 << 20, 0, "off", "cpu")
out["off"] = requested("off")
memsaver.set_backup_prepare_limit(4 << 20)
_memsaver.malloc(6 << 20, 0, "over", "cpu")                 # more than the limit
out["over"] = requested("over")
_memsaver.malloc(4 << 20, 0, "fits", "cpu")
out["fits"] = requested("fits")
for bad in (-1, True):
    try:
        memsaver.set_backup_prepare_limit(bad)
    except ValueError as e:
        out[repr(bad)] = str(e)
print(json.dumps(out))
"""


def test_backup_prepare_limit_bounds_what_is_prepared(child_env):
    """set_backup_prepare_limit reaches the allocator: 0 prepares nothing, and an allocation
    larger than the limit gets no prepared backup while one that fits does (the limit over
    several allocations and the bytes held: torch-shim/tests/own_process.rs)."""
    r = run_python(PREPARE_LIMIT, child_env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["off"], out["over"], out["fits"]) == (False, False, True)
    assert "takes a byte count >= 0, got -1" in out["-1"] and "got True" in out["True"]


BACKUP_RESERVE = r"""
import json, time
import memsaver
from memsaver import _memsaver

def settled(want_pinned):
    # The reserve pinned as far as asked and the request carved from it.
    for _ in range(2000):
        s = memsaver.stats()
        if s.backup_reserve_pinned_bytes == want_pinned and s.backups_preparing == 0:
            return s
        time.sleep(0.005)
    raise SystemExit(f"the reserve did not settle: {memsaver.stats()!r}")

out = {}
s = memsaver.stats()                                      # memsaver starts; no device used yet
out["before"] = [s.backup_reserve_bytes, s.backup_reserve_pinned_bytes]
_memsaver.malloc(4 << 20, 0, "loaded", "cpu")             # opens the device: the reserve starts
s = settled(8 << 20)
out["first"] = [s.backup_reserve_bytes, s.backup_reserve_used_bytes,
                s.tags["loaded"].prepared_backup_bytes]
registered = s.driver_calls["host_register"]
memsaver.pause("loaded")
s = memsaver.stats()
out["pause_pinned"] = s.driver_calls["host_register"] - registered
out["backup"] = s.tags["loaded"].pinned_backup_bytes
memsaver.resume("loaded")
memsaver.reserve_backups(16 << 20)
s = settled(16 << 20)
out["grown"] = [s.backup_reserve_bytes, s.backup_reserve_used_bytes]
for bad in (-1, True, 2**64):
    try:
        memsaver.reserve_backups(bad)
    except ValueError as e:
        out[repr(bad)] = str(e)
try:
    memsaver.reserve_backups(2**63)
except memsaver.InvalidArgumentError as e:
    out["huge"] = str(e)
print(json.dumps(out))
"""


def test_backup_reserve_is_pinned_and_lent_to_cpu_backups(child_env):
    """MEMSAVER_BACKUP_RESERVE_MB pins a reserve once the process uses a device, a cpu backup
    is carved from it (so the pause pins nothing), memsaver.reserve_backups grows it, the stats
    report it, and bad sizes are refused with the accepted range."""
    r = run_python(BACKUP_RESERVE, {**child_env, "MEMSAVER_BACKUP_RESERVE_MB": "8"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["before"] == [8 * MiB, 0], "the reserve waits for a device"
    assert out["first"] == [8 * MiB, 4 * MiB, 4 * MiB]
    assert (out["pause_pinned"], out["backup"]) == (0, 4 * MiB)
    assert out["grown"] == [16 * MiB, 4 * MiB]
    for bad in ("-1", "True", str(2**64)):
        assert f"takes a byte count from 0 to this host's memory, got {bad}" in out[bad]
    assert "more than this host's memory: expected 0 to" in out["huge"]


# A preloaded child under the torch stand-in: `malloc()` is the preloaded cudaMalloc of 2 MiB,
# as libc10_cuda reaches it, giving (status, pointer).
UNDER_FAKE_TORCH = r"""
import ctypes, json, sys
from fake_torch import FakeTorch
torch = sys.modules["torch"] = FakeTorch()
import memsaver
from memsaver import _memsaver

lib = ctypes.CDLL(None)
lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
def malloc():
    p = ctypes.c_void_p()
    return lib.cudaMalloc(ctypes.byref(p), 2 << 20), p.value
"""

WHOLE_PROCESS_PAUSE = UNDER_FAKE_TORCH + r"""
assert malloc()[0] == 0
_memsaver.malloc(2 << 20, 0, "other", "discard")
def calls():  # pause() synchronises torch's streams first: not the guard's doing
    return [c for c in torch.calls if c != ("synchronize",)]

out = {}
memsaver.pause("other")
out["other"] = calls()
memsaver.resume("other")
del torch.calls[:]
memsaver.pause("proc")
out["paused"] = calls()
rc, p = malloc()  # while paused: a resident allocation of the process tag
assert rc == 0
out["new"] = [a.state for a in memsaver.allocations("proc") if a.ptr == p]
del torch.calls[:]
memsaver.resume("proc")
out["resumed"] = calls()
print(json.dumps(out))
"""


def test_whole_process_pause_routes_torch_to_a_fresh_pool_until_resume(child_env):
    """Whole-process mode (preloaded, MEMSAVER_PROCESS_TAG): torch's default pool holds the
    process tag's memory, cached free blocks included. The pause guard drops torch's cuBLAS
    workspaces (made there) and routes every allocation to a fresh pool before the tag is
    paused, and ends the routing once the tag is resumed. Under a torch stand-in that records its calls (the real
    one: tests/gpu/paused_alloc.py)."""
    env = dict(child_env, LD_PRELOAD=memsaver.preload_path(), MEMSAVER_HOOK_MODE="preload",
               MEMSAVER_PROCESS_TAG="proc", PYTHONPATH=os.path.dirname(__file__))
    r = run_python(WHOLE_PROCESS_PAUSE, env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["other"] == [], "another tag: torch's default pool and cuBLAS workspaces stay"
    assert out["paused"] == [["clear_workspaces"], ["pool", "pool1", None], ["route", [1, 0], 0]]
    assert out["new"] == ["resident"]
    assert out["resumed"] == [["unroute", [1, 0], 0], ["freed", "pool1"]]


WHOLE_PROCESS_EMPTY_WHILE_PAUSED = UNDER_FAKE_TORCH + r"""
assert malloc()[0] == 0
memsaver.pause("proc")
del torch.calls[:]
torch.cuda.empty_cache()  # verl calls it right after a pause
out = {"empty_cache": list(torch.calls), "underway": [list(u) for u in torch.underway]}
del torch.calls[:]
with memsaver.disable():
    pass
out["disable"] = list(torch.calls)
memsaver.resume("proc")
del torch.calls[:]
torch.cuda.empty_cache()
out["after"] = list(torch.calls)
print(json.dumps(out))
"""


def test_emptying_torchs_cache_while_the_process_tag_is_paused(child_env):
    """Whole-process mode: while the process tag is paused, the pause guard routes torch's
    allocations to a pool, which torch counts as a graph capture underway; torch fails an
    internal assert (and aborts the process, from a MemPool's destructor) when a cache is
    emptied then. `torch.cuda.empty_cache()` and the release of disable()'s pool lift the
    routing for their call and put it back. The stand-in fails as torch does (the real one:
    torch_memory_saver's test_training_engine in tests/gpu/tms_suite.sh)."""
    env = dict(child_env, LD_PRELOAD=memsaver.preload_path(), MEMSAVER_HOOK_MODE="preload",
               MEMSAVER_PROCESS_TAG="proc", PYTHONPATH=os.path.dirname(__file__))
    r = run_python(WHOLE_PROCESS_EMPTY_WHILE_PAUSED, env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    route = [[1, 0], 0]
    assert out["empty_cache"] == [["unroute", *route], ["empty_cache"], ["route", *route]]
    assert out["underway"] == [[[1, 0], 0]], "still routed after the call"
    assert out["disable"] == [
        ["pool", "pool2", None], ["enter", "pool2", 0], ["exit", "pool2"],
        ["unroute", *route], ["freed", "pool2"], ["route", *route],
    ], "no assert: the pool is released with the routing lifted"
    assert out["after"] == [["empty_cache"]], "resumed: nothing routed, nothing to lift"


WHOLE_PROCESS_DISABLE = UNDER_FAKE_TORCH + r"""
out = {"outside": malloc()[0]}
with memsaver.disable():
    out["inside"] = malloc()[0]
    out["calls_inside"] = list(torch.calls)
out["calls"] = torch.calls
out["proc"] = memsaver.stats().tags["proc"].allocations
print(json.dumps(out))
"""


def test_disable_in_whole_process_mode_uses_a_pool_of_its_own(child_env):
    """Whole-process mode (preloaded, MEMSAVER_PROCESS_TAG): torch's default pool holds the
    process tag's memory, which may be paused, so disable() allocates from a private pool of
    torch's allocator and lets it go when the block ends. Under a torch stand-in that records
    its calls (the real one: tests/gpu/torch_hooks.py)."""
    env = dict(child_env, LD_PRELOAD=memsaver.preload_path(), MEMSAVER_HOOK_MODE="preload",
               MEMSAVER_PROCESS_TAG="proc", PYTHONPATH=os.path.dirname(__file__))
    r = run_python(WHOLE_PROCESS_DISABLE, env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["outside"] == 0 and out["proc"] == 1, "no region: the process tag"
    assert out["inside"] == 3, "disabled: forwarded (cudaErrorInitializationError: no libcudart)"
    # A plain pool (torch's own allocator, whose cudaMalloc the preload sees untagged), active
    # during the block only, and released with it.
    assert out["calls_inside"] == [["pool", "pool1", None], ["enter", "pool1", 0]]
    assert out["calls"] == [["pool", "pool1", None], ["enter", "pool1", 0], ["exit", "pool1"], ["freed", "pool1"]]
