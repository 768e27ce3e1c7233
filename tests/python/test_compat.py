"""memsaver.compat: torch_memory_saver's API (and `import torch_memory_saver` by alias) on the
fake driver."""

from __future__ import annotations

import inspect
import logging
import os

import memsaver
import pytest
from helpers import CUDA_ERROR_INITIALIZATION, CUDA_SUCCESS, MiB, pattern, read, run_python, write
from memsaver import _memsaver, compat
from memsaver.compat import TorchMemorySaver, configure_subprocess, torch_memory_saver


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
            assert rc == CUDA_ERROR_INITIALIZATION  # untagged: forwarded to the (absent) libcudart
        b = hooks.malloc_ok(2 * MiB)
    assert memsaver.stats().tags[tag].allocations == 2
    assert hooks.free(a) == hooks.free(b) == CUDA_SUCCESS


def test_pause_of_a_tag_without_allocations_only_warns(tag, caplog):
    memsaver.register_tag(tag)
    with caplog.at_level(logging.WARNING, logger="memsaver.compat"):
        torch_memory_saver.pause(f"{tag}_never_used")
        torch_memory_saver.resume(f"{tag}_never_used")
    assert "did nothing" in caplog.text and "known tags" in caplog.text and tag in caplog.text


def test_hook_mode_and_settings(hooks, tag):
    tms = TorchMemorySaver()
    assert tms.enabled
    assert tms.hook_mode == "torch"  # this process is not preloaded
    with torch_memory_saver.region(tag=tag):
        p = hooks.malloc_ok(2 * MiB)
    # The margin set through this object reaches the allocator: a resume that would leave less
    # than that free is refused, and resumes once the margin is 0 again.
    tms.pause(tag)
    free, _ = memsaver.device_memory(0)
    tms.memory_margin_bytes = free
    try:
        with pytest.raises(memsaver.ResumeOutOfMemoryError, match="margin"):
            tms.resume(tag)
        assert memsaver.stats().tags[tag].paused
    finally:
        tms.memory_margin_bytes = 0  # process-wide: leave it as the other tests expect
    tms.resume(tag)
    assert memsaver.stats().tags[tag].resident_bytes == 2 * MiB
    with pytest.raises(ValueError):
        tms.hook_mode = "cuda"
    tms.hook_mode = "preload"
    assert tms.hook_mode == "preload"
    with pytest.raises(memsaver.MemsaverError, match="LD_PRELOAD="):
        tms.pause()
    assert not memsaver.stats().tags[tag].paused, "the refused pause did nothing"
    tms.hook_mode = "torch"
    tms.pause()  # every tag
    t = memsaver.stats().tags[tag]
    assert (t.paused, t.resident_bytes) == (True, 0)
    tms.resume()
    t = memsaver.stats().tags[tag]
    assert (t.paused, t.resident_bytes) == (False, 2 * MiB)
    assert hooks.free(p) == CUDA_SUCCESS


def test_invalid_options_raise():
    with pytest.raises(ValueError, match="requires enable_cpu_backup"):
        with torch_memory_saver.region(tag="x", cpu_backup_backend="pinned"):
            pass
    with pytest.raises(ValueError, match="mutually exclusive"):
        with torch_memory_saver.region(tag="x", enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(ValueError, match="expected one of"):
        with torch_memory_saver.region(tag="x", enable_cpu_backup=True, cpu_backup_backend="nvme"):
            pass
    with pytest.raises(ValueError, match="CUDA tensor"):
        torch_memory_saver.get_cpu_backup(None)
    with pytest.raises(memsaver.InvalidArgumentError):
        torch_memory_saver.pause("")
    with pytest.raises(memsaver.InvalidArgumentError):  # nothing left open
        _memsaver.region_exit()


@pytest.mark.parametrize(
    ("kwargs", "policy"),
    [
        ({"enable_cpu_backup": True}, "cpu"),
        ({"enable_cpu_backup": True, "cpu_backup_backend": "pinned"}, "cpu"),
        ({"enable_cpu_backup": True, "cpu_backup_backend": "mmap"}, "mmap"),
        ({"enable_disk_backup": True}, "disk"),
    ],
)
def test_backups_keep_contents_and_are_released_after_resume(hooks, tag, tmp_path, kwargs, policy):
    torch_memory_saver.set_disk_backup_dir(str(tmp_path / "disk"))
    assert torch_memory_saver.retain_cpu_backup is False  # torch_memory_saver's default
    data = pattern(3 * MiB, seed=len(policy))
    with torch_memory_saver.region(tag=tag, **kwargs):
        p = hooks.malloc_ok(3 * MiB)
    write(p, data)
    torch_memory_saver.pause(tag)
    kind = {"cpu": "pinned", "mmap": "mmap", "disk": "disk"}[policy]
    assert getattr(memsaver.stats().tags[tag], f"{kind}_backup_bytes") == 4 * MiB
    host = _memsaver.backup_pointer(p + 4096, 100)
    if policy == "disk":
        assert host == 0 and len(list((tmp_path / "disk").iterdir())) == 1
    else:
        assert host and read(host, 100) == data[4096:4196]  # interior pointers work
    torch_memory_saver.resume(tag)
    assert read(p, len(data)) == data
    # Released after resume: torch_memory_saver's default is not to retain backups.
    assert _memsaver.backup_pointer(p, 100) == 0
    assert list((tmp_path / "disk").iterdir()) == []
    assert hooks.free(p) == CUDA_SUCCESS


def test_retain_cpu_backup_keeps_the_same_host_buffer(hooks, tag):
    data = pattern(2 * MiB)
    with torch_memory_saver.region(tag=tag, enable_cpu_backup=True):
        p = hooks.malloc_ok(2 * MiB)
    write(p, data)
    torch_memory_saver.retain_cpu_backup = True
    try:
        assert memsaver.retain_backups()
        torch_memory_saver.pause(tag)
        first = _memsaver.backup_pointer(p, 2 * MiB)
        torch_memory_saver.resume(tag)
        assert _memsaver.backup_pointer(p, 2 * MiB) == first  # kept across the resume
        write(p, data[::-1])
        torch_memory_saver.pause(tag)
        assert _memsaver.backup_pointer(p, 2 * MiB) == first  # reused, refreshed
        assert read(first, 2 * MiB) == data[::-1]
    finally:
        torch_memory_saver.retain_cpu_backup = False
    torch_memory_saver.resume(tag)
    assert read(p, 2 * MiB) == data[::-1]
    assert _memsaver.backup_pointer(p, 2 * MiB) == 0  # released by the non-retaining resume
    assert hooks.free(p) == CUDA_SUCCESS


def test_memory_margin_is_applied(hooks, tag):
    with torch_memory_saver.region(tag=tag):
        p = hooks.malloc_ok(2 * MiB)
    torch_memory_saver.pause(tag)
    free, _ = memsaver.device_memory(0)
    torch_memory_saver.memory_margin_bytes = free  # resuming 2 MiB would go below it
    try:
        with pytest.raises(memsaver.ResumeOutOfMemoryError, match="margin"):
            torch_memory_saver.resume(tag)
        assert memsaver.stats().tags[tag].paused  # nothing half-done
    finally:
        torch_memory_saver.memory_margin_bytes = 0
    torch_memory_saver.resume(tag)
    assert hooks.free(p) == CUDA_SUCCESS


_ALIAS_PROBE = """
import sys, torch_memory_saver, memsaver.compat
from torch_memory_saver import torch_memory_saver as tms, configure_subprocess
from torch_memory_saver.hooks import mode_preload
from torch_memory_saver.utils import change_env
from torch_memory_saver.testing_utils import get_and_print_gpu_memory
assert torch_memory_saver is memsaver.compat, torch_memory_saver
assert tms is memsaver.compat.torch_memory_saver
assert mode_preload.configure_subprocess is configure_subprocess
print("alias ok")
"""


def test_import_torch_memory_saver_alias_is_opt_in(child_env):
    env = dict(child_env, MEMSAVER_TORCH_MEMORY_SAVER="1")
    r = run_python(_ALIAS_PROBE, env)
    assert r.returncode == 0 and "alias ok" in r.stdout, r.stderr
    env["MEMSAVER_TORCH_MEMORY_SAVER"] = "0"
    r = run_python("import torch_memory_saver", env)
    assert r.returncode != 0 and "No module named 'torch_memory_saver'" in r.stderr


def test_alias_says_when_it_shadows_an_installed_torch_memory_saver(child_env, tmp_path):
    fake = tmp_path / "site" / "torch_memory_saver"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    env = dict(child_env, MEMSAVER_TORCH_MEMORY_SAVER="1", PYTHONPATH=str(tmp_path / "site"))
    r = run_python("import torch_memory_saver as t; assert not hasattr(t, 'REAL')", env)
    assert r.returncode == 0, r.stderr
    assert "is not used" in r.stderr and str(fake) in r.stderr


def test_configure_subprocess_prepends_the_library_and_restores(monkeypatch):
    from memsaver.compat.hooks import mode_preload

    monkeypatch.setenv("LD_PRELOAD", "/other/lib.so")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == f"{memsaver.preload_path()}:/other/lib.so"
        assert os.environ["MEMSAVER_HOOK_MODE"] == "preload"
    assert os.environ["LD_PRELOAD"] == "/other/lib.so"
    monkeypatch.setattr(mode_preload, "get_binary_path_from_package", lambda stem: "/x.so")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == "/x.so:/other/lib.so"


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
    assert compat.configure_subprocess is compat.hooks.mode_preload.configure_subprocess
