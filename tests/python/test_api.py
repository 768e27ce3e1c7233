"""The public API in this process (in-process mode), through the interposed cudaMalloc as torch
would call it, on the fake driver."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading

import memsaver
import pytest
from helpers import (
    CUDA_ERROR_INITIALIZATION,
    CUDA_SUCCESS,
    MiB,
    cudart_loaded,
    pattern,
    read,
    run_python,
    write,
)
from memsaver import _memsaver


def test_region_tags_hooked_cudamalloc(hooks, tag):
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(3 * MiB)
    t = memsaver.stats().tags[tag]
    assert (t.allocations, t.paused) == (1, False)
    assert t.reserved_bytes == t.resident_bytes == 4 * MiB  # rounded to the 2 MiB granularity
    assert t.backup_bytes == 0
    assert set(t.devices) == {0}
    write(p, b"hello")
    assert read(p, 5) == b"hello"
    assert hooks.free(p) == CUDA_SUCCESS
    assert memsaver.stats().tags[tag].allocations == 0


def test_cudamalloc_outside_region_forwards_to_cudart(hooks):
    before = memsaver.stats().total.allocations
    rc, p = hooks.malloc(2 * MiB)
    # Forwarded to libcudart, which this process has not loaded: the hook's own
    # cudaErrorInitializationError, not a tagged block (nor an allocation failure, 2).
    assert not cudart_loaded()
    assert (rc, p) == (CUDA_ERROR_INITIALIZATION, 0)
    assert memsaver.stats().total.allocations == before


# A libcudart.so.13 stand-in: cudaMalloc hands out pointers into a static arena and cudaFree
# takes them back; both count their calls and return codes of their own, so that a test sees
# that a call reached it and what it answered.
_STUB_CUDART = r"""
#include <stddef.h>
char stub_arena[1 << 16];
static size_t used;
int stub_mallocs, stub_frees;
int cudaMalloc(void **p, size_t n) {
    stub_mallocs++;
    if (n > sizeof stub_arena - used) return 2; /* cudaErrorMemoryAllocation */
    *p = stub_arena + used;
    used += n;
    return 0;
}
int cudaFree(void *p) {
    stub_frees++;
    return (char *)p >= stub_arena && (char *)p < stub_arena + sizeof stub_arena ? 0 : 1;
}
"""

_FORWARDING = r"""
import ctypes, json, sys
import memsaver
from memsaver import _memsaver

stub = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)   # loaded as torch loads libcudart
memsaver.hook_mode()
lib = ctypes.CDLL(memsaver.preload_path())
lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
lib.cudaFree.argtypes = [ctypes.c_void_p]
count = lambda name: ctypes.c_int.in_dll(stub, name).value

def malloc(n):
    p = ctypes.c_void_p()
    return lib.cudaMalloc(ctypes.byref(p), n), p.value or 0

out = {}
out["outside"] = malloc(4096) + (count("stub_mallocs"),)
with memsaver.region("tagged"):
    out["region"] = malloc(2 << 20) + (count("stub_mallocs"),)
    with memsaver.disable():
        out["disabled"] = malloc(8192) + (count("stub_mallocs"),)
out["too_big"] = malloc(1 << 20) + (count("stub_mallocs"),)   # cudart's own error, passed on
out["free_cudart"] = (lib.cudaFree(out["outside"][1]), count("stub_frees"))
out["free_memsaver"] = (lib.cudaFree(out["region"][1]), count("stub_frees"))
out["arena"] = ctypes.addressof(ctypes.c_char.in_dll(stub, "stub_arena"))
out["tagged"] = memsaver.stats().tags["tagged"].allocations
print(json.dumps(out))
"""


def test_forwarded_calls_reach_libcudart(child_env, tmp_path):
    """With a libcudart in the process (as under torch), a call the hook does not keep gets
    cudart's answer, pointer and status unchanged; a cudaFree of memsaver memory never reaches
    cudart."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the libcudart stand-in")
    src, so = tmp_path / "cudart.c", tmp_path / "libcudart.so.13"
    src.write_text(_STUB_CUDART)
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcudart.so.13", "-o", str(so), str(src)], check=True)
    r = run_python(_FORWARDING, child_env, str(so))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    arena = out["arena"]
    assert out["outside"] == [CUDA_SUCCESS, arena, 1]  # cudart's first block
    rc, p, calls = out["region"]
    assert (rc, calls) == (CUDA_SUCCESS, 1) and not arena <= p < arena + (1 << 16)  # memsaver's
    assert out["disabled"] == [CUDA_SUCCESS, arena + 4096, 2]  # disable() forwards again
    assert out["too_big"] == [2, 0, 3]  # cudaErrorMemoryAllocation, from cudart
    assert out["free_cudart"] == [CUDA_SUCCESS, 1]
    assert out["free_memsaver"] == [CUDA_SUCCESS, 1], "memsaver's block never reaches cudart"
    assert out["tagged"] == 0


def test_cpu_backup_restores_contents_at_same_address(hooks, tag):
    size = 4 * MiB
    data = pattern(size)
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(size)
    write(p, data)

    memsaver.pause(tag)
    t = memsaver.stats().tags[tag]
    assert t.paused and t.allocations == 1
    assert t.resident_bytes == 0
    assert t.reserved_bytes == size
    assert t.backup_bytes == size

    memsaver.resume(tag)
    t = memsaver.stats().tags[tag]
    assert not t.paused and t.resident_bytes == size
    assert read(p, size) == data  # same address, same bytes
    assert hooks.free(p) == CUDA_SUCCESS


def test_discard_keeps_no_backup_and_memory_is_usable_after_resume(hooks, tag):
    with memsaver.region(tag):  # backup="discard" by default
        p = hooks.malloc_ok(2 * MiB)
    write(p, b"x" * 64)
    memsaver.pause(tag)
    t = memsaver.stats().tags[tag]
    assert (t.resident_bytes, t.backup_bytes) == (0, 0)
    memsaver.resume(tag)
    write(p, b"y" * 64)
    assert read(p, 64) == b"y" * 64
    assert hooks.free(p) == CUDA_SUCCESS


def test_pause_and_resume_without_arguments_cover_every_tag(hooks, tag, tag2):
    with memsaver.region(tag, backup="cpu"):
        a = hooks.malloc_ok(2 * MiB)
    with memsaver.region(tag2):
        b = hooks.malloc_ok(2 * MiB)
    write(a, b"kept")
    memsaver.pause()
    s = memsaver.stats()
    assert all(t.paused for t in s.tags.values())
    assert s.total.resident_bytes == 0
    memsaver.resume()
    s = memsaver.stats()
    assert not any(t.paused for t in s.tags.values())
    assert s.tags[tag].resident_bytes == s.tags[tag2].resident_bytes == 2 * MiB
    assert read(a, 4) == b"kept"
    assert hooks.free(a) == hooks.free(b) == CUDA_SUCCESS


def test_pause_and_resume_are_idempotent(hooks, tag):
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(2 * MiB)
    write(p, b"twice")
    memsaver.pause(tag)
    memsaver.pause(tag)
    assert memsaver.stats().tags[tag].resident_bytes == 0
    memsaver.resume(tag)
    memsaver.resume(tag)
    t = memsaver.stats().tags[tag]
    assert (t.paused, t.resident_bytes) == (False, 2 * MiB)
    assert read(p, 5) == b"twice"
    assert hooks.free(p) == CUDA_SUCCESS


def test_free_while_paused(hooks, tag):
    with memsaver.region(tag, backup="cpu"):
        p = hooks.malloc_ok(2 * MiB)
        q = _memsaver.malloc(2 * MiB, 0, tag, "cpu")
    memsaver.pause(tag)
    assert hooks.free(p) == CUDA_SUCCESS
    _memsaver.free(q)
    t = memsaver.stats().tags[tag]
    assert (t.allocations, t.reserved_bytes, t.backup_bytes) == (0, 0, 0)
    memsaver.resume(tag)
    with pytest.raises(memsaver.UnknownPointerError):
        _memsaver.free(q)


@pytest.fixture
def no_prepared_backups():
    """No pinned backup is prepared in the background for allocations made in the test (the
    limit is process-wide: back to the default, no limit, after it)."""
    memsaver.set_backup_prepare_limit(0)
    yield
    memsaver.set_backup_prepare_limit(2**64 - 1)


def test_stats_figures_add_up(hooks, tag, tag2, no_prepared_backups):
    with memsaver.region(tag):
        p = hooks.malloc_ok(2 * MiB)
    # No backup prepared in the background: the figures are what they are when malloc returns
    # (the prepared figure: test_backup_prepare_limit_bounds_what_is_prepared).
    q = _memsaver.malloc(4 * MiB, 1, tag2, "cpu")  # the fake driver has two devices
    s = memsaver.stats()
    assert isinstance(s, memsaver.Stats)
    t2 = s.tags[tag2]
    assert isinstance(t2, memsaver.TagStats)
    assert t2.devices == {1: memsaver.Usage(1, 4 * MiB, 4 * MiB, 0, prepared_backup_bytes=0)}
    for field in ("allocations", "reserved_bytes", "resident_bytes", "backup_bytes"):
        assert getattr(s.total, field) == sum(getattr(t, field) for t in s.tags.values())
    text = str(s)
    assert tag in text and tag2 in text and "total" in text and "4.0 MiB" in text
    memsaver.pause(tag2)
    assert "paused" in str(memsaver.stats())
    memsaver.resume(tag2)
    _memsaver.free(q)
    assert hooks.free(p) == CUDA_SUCCESS


def test_register_tag_makes_it_pausable_and_listed(tag):
    with pytest.raises(memsaver.UnknownTagError):
        memsaver.pause(tag)
    memsaver.register_tag(tag)
    t = memsaver.stats().tags[tag]
    assert (t.allocations, t.reserved_bytes, t.paused) == (0, 0, False)
    assert tag in str(memsaver.stats())
    memsaver.pause(tag)
    # Paused: it says so, and allocating into it is refused until it is resumed.
    assert memsaver.stats().tags[tag].paused
    with pytest.raises(memsaver.TagPausedError):
        _memsaver.malloc(2 * MiB, 0, tag, "discard")
    memsaver.resume(tag)
    assert not memsaver.stats().tags[tag].paused
    p = _memsaver.malloc(2 * MiB, 0, tag, "discard")
    assert memsaver.stats().tags[tag].resident_bytes == 2 * MiB
    _memsaver.free(p)


def test_unknown_tag_lists_known_tags(tag):
    memsaver.register_tag(tag)
    with pytest.raises(memsaver.UnknownTagError) as e:
        memsaver.pause(f"{tag}_missing")
    assert f"'{tag}_missing'" in str(e.value)
    assert "known tags" in str(e.value) and tag in str(e.value)
    assert isinstance(e.value, memsaver.MemsaverError)
    assert type(e.value).__module__ == "memsaver"
    with pytest.raises(memsaver.UnknownTagError):
        memsaver.resume(f"{tag}_missing")


def test_bad_policy_and_bad_tag_are_refused_without_opening_a_region(tag):
    with pytest.raises(memsaver.InvalidArgumentError, match="discard.*cpu"):
        with memsaver.region(tag, backup="gpu"):
            pass
    with pytest.raises(memsaver.InvalidArgumentError, match="invalid tag"):
        with memsaver.region("no spaces, no commas"):
            pass
    # Nothing was left open on this thread.
    with pytest.raises(memsaver.InvalidArgumentError, match="without a matching"):
        _memsaver.region_exit()


def test_pause_takes_tags_as_separate_strings(tag):
    with pytest.raises(TypeError, match="separate str arguments"):
        memsaver.pause([tag])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        memsaver.resume(None)  # type: ignore[arg-type]


def test_allocating_into_a_paused_tag_fails(hooks, tag):
    with memsaver.region(tag):
        p = hooks.malloc_ok(2 * MiB)
    memsaver.pause(tag)
    with pytest.raises(memsaver.TagPausedError, match="resume it"):
        _memsaver.malloc(2 * MiB, 0, tag, "discard")
    # Entering the paused tag's region is refused: a caching allocator would reuse its
    # unmapped blocks.
    with pytest.raises(memsaver.TagPausedError, match="entering its region"):
        with memsaver.region(tag):
            pass
    assert memsaver.stats().tags[tag].allocations == 1
    memsaver.resume(tag)
    assert hooks.free(p) == CUDA_SUCCESS


def test_region_exit_without_enter():
    with pytest.raises(memsaver.InvalidArgumentError, match="without a matching"):
        _memsaver.region_exit()


def test_region_closes_when_the_block_raises(tag):
    with pytest.raises(RuntimeError, match="boom"):
        with memsaver.region(tag):
            raise RuntimeError("boom")
    with pytest.raises(memsaver.InvalidArgumentError):
        _memsaver.region_exit()


def test_nested_regions_innermost_wins(hooks, tag, tag2):
    with memsaver.region(tag):
        a = hooks.malloc_ok(2 * MiB)
        with memsaver.region(tag2, backup="cpu"):
            b = hooks.malloc_ok(2 * MiB)
        c = hooks.malloc_ok(2 * MiB)
    s = memsaver.stats()
    assert s.tags[tag].allocations == 2
    assert s.tags[tag2].allocations == 1
    for p in (a, b, c):
        assert hooks.free(p) == CUDA_SUCCESS


def test_disable_nests_inside_and_around_regions(hooks, tag, tag2):
    with memsaver.region(tag):
        a = hooks.malloc_ok(2 * MiB)
        with memsaver.disable():
            rc, _ = hooks.malloc(2 * MiB)
            assert rc == CUDA_ERROR_INITIALIZATION  # untagged: forwarded to the (absent) libcudart
            with memsaver.region(tag2):
                b = hooks.malloc_ok(2 * MiB)
            rc, _ = hooks.malloc(2 * MiB)
            assert rc == CUDA_ERROR_INITIALIZATION
        c = hooks.malloc_ok(2 * MiB)
    s = memsaver.stats()
    assert s.tags[tag].allocations == 2
    assert s.tags[tag2].allocations == 1
    with memsaver.disable():
        rc, _ = hooks.malloc(2 * MiB)
        assert rc == CUDA_ERROR_INITIALIZATION
    with pytest.raises(memsaver.InvalidArgumentError):
        _memsaver.region_exit()
    for p in (a, b, c):
        assert hooks.free(p) == CUDA_SUCCESS


def test_disable_under_torch_suspends_the_region_pool(hooks, tag, monkeypatch):
    """Under torch (a stand-in recording its calls; the real one: tests/gpu/torch_hooks.py), a
    region allocates from its tag's pool, and disable() inside it suspends that pool, so that
    the block's tensors come from torch's default pool (untagged), then brings it back."""
    import sys

    from fake_torch import FakeTorch
    from memsaver import _torch

    torch = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    # Pools and the pluggable allocator are kept for the process: start and leave them empty.
    monkeypatch.setattr(_torch, "_pools", {})
    monkeypatch.setattr(_torch, "_allocator", None)
    with memsaver.region(tag):
        assert torch.calls == [("pool", "pool1", "memsaver's pluggable allocator"), ("enter", "pool1", 0)]
        with memsaver.disable():
            assert torch.calls[2:] == [("exit", "pool1")], "no pool: torch's default one"
            rc, _ = hooks.malloc(2 * MiB)
            assert rc == CUDA_ERROR_INITIALIZATION  # untagged: forwarded
        assert torch.calls[3:] == [("enter", "pool1", 0)]
    assert torch.calls[4:] == [("exit", "pool1")]
    assert memsaver.stats().tags[tag].allocations == 0


def test_a_pause_of_a_tag_whose_region_is_open_is_refused_under_torch(tag, tag2, monkeypatch):
    """Under torch (a stand-in; the real one: tests/gpu/paused_alloc.py) a region's pool would
    hand its cached blocks of paused memory to the tensors of a region still open, so a pause of
    its tag is refused, naming the thread, until the block ends; other tags pause meanwhile."""
    import sys
    import threading

    from fake_torch import FakeTorch
    from memsaver import _torch

    monkeypatch.setitem(sys.modules, "torch", FakeTorch())
    monkeypatch.setattr(_torch, "_pools", {})
    monkeypatch.setattr(_torch, "_allocator", None)
    memsaver.register_tag(tag)
    memsaver.register_tag(tag2)
    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with memsaver.region(tag):
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=hold, name="rollout-worker")
    t.start()
    try:
        assert entered.wait(30)
        refusal = f"region of tag '{tag}' is open on thread 'rollout-worker'"
        with pytest.raises(memsaver.PauseRefusedError, match=refusal):
            memsaver.pause(tag2, tag)
        assert not memsaver.stats().tags[tag2].paused, "a refused pause changes nothing"
        memsaver.pause(tag2)
        memsaver.resume(tag2)
    finally:
        leave.set()
        t.join()
    memsaver.pause(tag)
    memsaver.resume(tag)


def test_cuda_graph_tags_the_capture_under_torch(hooks, tag, tag2, monkeypatch):
    """Under torch (a stand-in recording its calls; the real one: tests/gpu/torch_hooks.py),
    cuda_graph captures into a pool of its own over memsaver's allocator, kept alive with the
    graph, with the tag's region open: what the capture allocates is the tag's, and pausing
    the tag gives it back. An enclosing region's pool is suspended meanwhile."""
    import sys

    from fake_torch import FakeTorch
    from memsaver import _torch

    torch = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(_torch, "_pools", {})
    monkeypatch.setattr(_torch, "_allocator", None)

    class Graph:
        pass

    g = Graph()
    with memsaver.region(tag2):
        with memsaver.cuda_graph(g, tag=tag, backup="cpu", capture_error_mode="thread_local"):
            current = json.loads(_memsaver.region_current_json())
            p = hooks.malloc_ok(2 * MiB)  # what the capture allocates, through the hook
    alloc = "memsaver's pluggable allocator"
    assert torch.calls == [
        ("pool", "pool1", alloc), ("enter", "pool1", 0),  # the enclosing region
        ("exit", "pool1"),  # suspended for the capture
        ("pool", "pool2", alloc), ("capture", (2, 0), {"capture_error_mode": "thread_local"}), ("captured",),
        ("enter", "pool1", 0), ("exit", "pool1"),
    ]
    assert g._memsaver_pool.id == (2, 0), "the capture's pool lives as long as the graph"
    assert (current["tag"], current["policy"]) == (tag, "cpu")
    s = memsaver.stats().tags
    assert (s[tag].allocations, s[tag2].allocations) == (1, 0)
    write(p, b"graph")
    memsaver.pause(tag)
    # Kernels still queued finish before the pause. cuBLAS workspaces stay: a graph captured
    # with a matmul keeps using the one of its capture.
    assert torch.calls[-1] == ("synchronize",)
    assert memsaver.stats().tags[tag].resident_bytes == 0
    memsaver.resume(tag)
    assert read(p, 5) == b"graph"
    assert hooks.free(p) == CUDA_SUCCESS


def test_regions_are_per_thread(hooks, tag):
    results = {}

    def other_thread():
        results["rc"], _ = hooks.malloc(2 * MiB)

    with memsaver.region(tag):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert results["rc"] == CUDA_ERROR_INITIALIZATION  # forwarded: this thread's region does not apply there
    assert memsaver.stats().tags[tag].allocations == 0


def test_hook_mode_and_preload_path():
    assert memsaver.hook_mode() == "inprocess"
    assert memsaver.preload_path().endswith("/memsaver/libmemsaver.so")
    assert _memsaver.loaded() == ("inprocess", memsaver.preload_path())
    with pytest.raises(memsaver.MemsaverError, match="LD_PRELOAD="):
        memsaver.require_preload()


def test_hook_mode_env_preload_says_how_to_start(monkeypatch):
    monkeypatch.setenv("MEMSAVER_HOOK_MODE", "preload")
    with pytest.raises(memsaver.MemsaverError) as e:
        memsaver.pause()
    msg = str(e.value)
    assert f"LD_PRELOAD={memsaver.preload_path()} python" in msg
    assert "python -m memsaver env" in msg
    assert memsaver.hook_mode() == "inprocess"  # asking is always allowed
    monkeypatch.setenv("MEMSAVER_HOOK_MODE", "sometimes")
    with pytest.raises(memsaver.MemsaverError, match="not a hook mode"):
        memsaver.stats()
    monkeypatch.setenv("MEMSAVER_HOOK_MODE", "inprocess")
    memsaver.stats()


def test_exceptions_and_all():
    for name in memsaver.__all__:
        assert hasattr(memsaver, name), name
    errors = [getattr(memsaver, n) for n in memsaver.__all__ if n.endswith("Error")]
    # One per status a caller can act on (python/src/error.rs), plus MemsaverError and
    # ProfileStepError.
    assert len(errors) == 16
    for cls in errors:
        assert issubclass(cls, memsaver.MemsaverError)
        # Raised by the extension, except ProfileStepError (raised by the profile runner).
        if cls is not memsaver.ProfileStepError:
            assert cls is getattr(_memsaver, cls.__name__)
    assert issubclass(memsaver.ResumeOutOfMemoryError, memsaver.OutOfMemoryError)
    assert memsaver.BackupError in errors  # MEMSAVER_ERR_BACKUP
    assert memsaver.ControlError in errors  # MEMSAVER_ERR_CONTROL
    assert memsaver.PauseRefusedError in errors  # MEMSAVER_ERR_PAUSE_REFUSED


def test_cuda_graph_needs_torch():
    import sys

    if "torch" in sys.modules:
        pytest.skip("torch is imported in this process")
    with pytest.raises(memsaver.MemsaverError, match="PyTorch"):
        with memsaver.cuda_graph(object()):
            pass


def test_nccl_stats_without_nccl():
    s = memsaver.nccl_stats()
    # Nothing resolved driver calls through the hook in this process (no NCCL, no preload).
    assert s["hooked"] is False
    assert s["owned_bytes"] == 0 and s["imported_bytes"] == 0
    expected = {"cumem_disabled", "paused", "exported_handles", "resident_pinned_bytes", "mappings"}
    assert set(s) >= expected
    assert s["stack_lowered_bytes"] == 0 and s["stack_kept_bytes"] == 0
    assert s["stack_kept_reason"] is None
    assert s["application"] == {
        "allocations": 0, "bytes": 0, "tagged_bytes": {}, "untagged_bytes": 0,
    }


def test_nccl_is_a_tag_beside_the_others():
    # Without NCCL in the process the tag is empty: pausing it (alone or with every tag) is a
    # no-op that succeeds, and allocating with its name is refused.
    memsaver.pause("nccl")
    assert memsaver.stats().tags["nccl"].paused
    memsaver.resume("nccl")
    assert not memsaver.stats().tags["nccl"].paused
    with pytest.raises(memsaver.InvalidArgumentError, match="reserved"):
        _memsaver.malloc(2 * MiB, 0, "nccl", "discard")


def test_nccl_group_set_and_read():
    before = memsaver.group()
    try:
        memsaver.set_group(42)
        assert memsaver.group() == 42
    finally:
        memsaver.set_group(before)
    assert memsaver.group() == before


@pytest.mark.parametrize("bad", [3.9, "7", True, None])
def test_set_group_refuses_what_is_not_an_int(bad):
    before = memsaver.group()
    with pytest.raises(TypeError, match="takes an int"):
        memsaver.set_group(bad)
    assert memsaver.group() == before


@pytest.mark.parametrize("bad", [-(2**63), 2**31, -(2**31) - 1])
def test_set_group_refuses_groups_out_of_range(bad):
    before = memsaver.group()
    with pytest.raises(memsaver.InvalidArgumentError, match="out of range"):
        memsaver.set_group(bad)
    assert memsaver.group() == before


def test_nccl_group_from_environment():
    import os
    import subprocess
    import sys

    env = dict(os.environ, MEMSAVER_GROUP="7")
    out = subprocess.run([sys.executable, "-c", "import memsaver; print(memsaver.group())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7"


@pytest.mark.parametrize("bad", ["", " ", ",", "a,b", "kv cache"])
def test_empty_blank_and_separator_tags_are_refused(hooks, tag, bad):
    with memsaver.region(tag):
        p = hooks.malloc_ok(2 * MiB)
    for fn in (memsaver.pause, memsaver.resume):
        with pytest.raises(memsaver.InvalidArgumentError, match="tag"):
            fn(bad)
        with pytest.raises(memsaver.InvalidArgumentError, match="tag"):
            fn(tag, bad)
    # Nothing was paused by the refused calls; only no argument at all means every tag.
    assert not memsaver.stats().tags[tag].paused
    assert hooks.free(p) == CUDA_SUCCESS
