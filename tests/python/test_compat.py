"""memsaver.compat.torch_memory_saver: torch_memory_saver 0.0.10's API on the fake driver."""

from __future__ import annotations

import inspect
import logging

import memsaver
import pytest
from helpers import CUDA_SUCCESS, MiB, pattern, read, write
from memsaver import _memsaver, compat
from memsaver.compat import TorchMemorySaver, torch_memory_saver


def test_region_pause_resume_with_tags(hooks, tag, tag2):
    data = pattern(2 * MiB)
    with torch_memory_saver.region(tag=tag, enable_cpu_backup=True):
        w = hooks.malloc_ok(2 * MiB)
    with torch_memory_saver.region(tag=tag2):
        kv = hooks.malloc_ok(2 * MiB)
    write(w, data)
    torch_memory_saver.pause(tag2)
    torch_memory_saver.pause(tag)
    s = memsaver.stats()
    assert s.tags[tag].paused and s.tags[tag2].paused
    assert s.tags[tag].backup_bytes == 2 * MiB and s.tags[tag2].backup_bytes == 0
    torch_memory_saver.resume(tag)
    torch_memory_saver.resume(tag2)
    assert read(w, len(data)) == data
    assert hooks.free(w) == hooks.free(kv) == CUDA_SUCCESS


def test_default_tag_and_pause_everything(hooks):
    with torch_memory_saver.region():
        p = hooks.malloc_ok(2 * MiB)
    assert memsaver.stats().tags["default"].allocations >= 1
    torch_memory_saver.pause()
    assert memsaver.stats().total.resident_bytes == 0
    # torch_memory_saver knows no NCCL memory: pausing "everything" leaves the nccl tag alone.
    assert not memsaver.stats().tags["nccl"].paused
    torch_memory_saver.resume()
    assert not any(t.paused for t in memsaver.stats().tags.values())
    assert hooks.free(p) == CUDA_SUCCESS


def test_disable_inside_region(hooks, tag):
    with torch_memory_saver.region(tag=tag):
        a = hooks.malloc_ok(2 * MiB)
        with torch_memory_saver.disable():
            rc, _ = hooks.malloc(2 * MiB)
            assert rc != CUDA_SUCCESS  # untagged: forwarded to the (absent) libcudart
        b = hooks.malloc_ok(2 * MiB)
    assert memsaver.stats().tags[tag].allocations == 2
    assert hooks.free(a) == hooks.free(b) == CUDA_SUCCESS


def test_pause_of_a_tag_without_allocations_only_warns(tag, caplog):
    memsaver.register_tag(tag)
    with caplog.at_level(logging.WARNING, logger="memsaver.compat"):
        torch_memory_saver.pause(f"{tag}_never_used")
        torch_memory_saver.resume(f"{tag}_never_used")
    assert "did nothing" in caplog.text and "known tags" in caplog.text and tag in caplog.text


def test_hook_mode_and_settings():
    tms = TorchMemorySaver()
    assert tms.enabled
    assert tms.hook_mode == "torch"  # this process is not preloaded
    tms.memory_margin_bytes = 1 << 30
    assert tms.memory_margin_bytes == 1 << 30
    with pytest.raises(ValueError):
        tms.hook_mode = "cuda"
    tms.hook_mode = "preload"
    assert tms.hook_mode == "preload"
    with pytest.raises(memsaver.MemsaverError, match="LD_PRELOAD="):
        tms.pause()
    tms.hook_mode = "torch"
    tms.resume()  # every tag; nothing is paused, so nothing to do


def test_unsupported_options_raise():
    with pytest.raises(NotImplementedError):
        with torch_memory_saver.region(tag="x", enable_disk_backup=True):
            pass
    with pytest.raises(ValueError):
        with torch_memory_saver.region(tag="x", cpu_backup_backend="pinned"):
            pass
    with pytest.raises(NotImplementedError):
        torch_memory_saver.set_disk_backup_dir("/tmp")
    with pytest.raises(NotImplementedError):
        torch_memory_saver.get_cpu_backup(None)
    with pytest.raises(memsaver.InvalidArgumentError):  # nothing left open
        _memsaver.region_exit()


def test_signatures_match_torch_memory_saver():
    def params(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(TorchMemorySaver.region)[:3] == [
        ("self", inspect.Parameter.empty),
        ("tag", "default"),
        ("enable_cpu_backup", False),
    ]
    assert params(TorchMemorySaver.cuda_graph)[:7] == [
        ("self", inspect.Parameter.empty),
        ("cuda_graph", inspect.Parameter.empty),
        ("pool", None),
        ("stream", None),
        ("capture_error_mode", "global"),
        ("tag", "default"),
        ("enable_cpu_backup", False),
    ]
    assert params(TorchMemorySaver.pause) == [("self", inspect.Parameter.empty), ("tag", None)]
    assert params(TorchMemorySaver.resume) == [("self", inspect.Parameter.empty), ("tag", None)]
    assert compat.configure_subprocess is memsaver.configure_subprocess
