"""memsaver's vLLM plugin against vLLM 0.33.0's own modules: the entry point vLLM discovers,
opting in and out, vLLM's allocator protocol, its sleep levels through vLLM's own ``cumem``
backend and through memsaver's backend, staged ``wake_up(tags)``, ``discard``, and a wake-up
that runs out of memory. Memory is allocated through libmemsaver.so's pluggable-allocator entry
points inside ``use_memory_pool`` blocks, as torch does on a GPU; on the fake driver it is host
memory, read and written with ctypes."""

from __future__ import annotations

import ctypes
import importlib.metadata
from typing import Any

import memsaver
import pytest
from conftest import Pluggable, run_child

MiB = 1 << 20


def fill(ptr: int, seed: int, n: int = 4096) -> None:
    ctypes.memmove(ptr, bytes((i * 7 + seed) & 0xFF for i in range(n)), n)


def holds(ptr: int, seed: int, n: int = 4096) -> bool:
    return ctypes.string_at(ptr, n) == bytes((i * 7 + seed) & 0xFF for i in range(n))


def mapped(allocator: Any) -> int:
    """What vLLM's tests call ``mapped_usage``: bytes of allocations not asleep."""
    return sum(d.handle[1] for d in allocator.pointer_to_data.values() if not d.is_asleep)


# -- the entry point and opting in ---------------------------------------------------------


def test_the_wheel_declares_the_entry_point_vllm_loads():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "memsaver"]
    assert [ep.value for ep in ours] == ["memsaver.vllm:register"]
    assert ours[0].dist is not None and ours[0].dist.name == "memsaver"
    from vllm.plugins import load_plugins_by_group

    assert "memsaver" in load_plugins_by_group("vllm.general_plugins")


_STATE = """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.device_allocator.cumem import CuMemAllocator
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
import memsaver.vllm
from memsaver import _memsaver
print(json.dumps({
    "registered": "memsaver" in SleepModeBackendFactory._registry,
    "installed": isinstance(CuMemAllocator.instance, memsaver.vllm.Allocator),
    "get_instance": CuMemAllocator.get_instance() is memsaver.vllm.allocator()
        if isinstance(CuMemAllocator.instance, memsaver.vllm.Allocator) else None,
    "library_loaded": _memsaver.loaded() is not None,
    "backend": SleepModeBackendFactory.get_backend_class("memsaver").__name__,
}))
"""


def _state(**env: str) -> dict[str, Any]:
    import json

    r = run_child(_STATE, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_without_opting_in_the_plugin_only_registers_the_backend_name():
    s = _state()
    assert s["registered"] and s["backend"] == "MemsaverBackend"
    assert not s["installed"], "vLLM keeps its own allocator"
    assert not s["library_loaded"], "libmemsaver.so is not even loaded"
    assert _state(MEMSAVER_VLLM="0")["installed"] is False


def test_memsaver_vllm_1_installs_memsavers_allocator_in_the_process():
    s = _state(MEMSAVER_VLLM="1")
    assert s["registered"] and s["installed"] and s["get_instance"] and s["library_loaded"]


def test_an_invalid_opt_in_value_fails_loudly():
    r = run_child(_STATE, MEMSAVER_VLLM="maybe")
    assert r.returncode != 0
    assert "MEMSAVER_VLLM='maybe': expected 0 or 1" in r.stderr


def test_a_library_that_cannot_be_loaded_is_a_clear_error():
    # A process that must run preloaded and is not: memsaver's library cannot serve it.
    r = run_child(_STATE, MEMSAVER_VLLM="1", MEMSAVER_HOOK_MODE="preload")
    assert r.returncode != 0
    err = r.stderr
    assert "memsaver.vllm: vLLM's sleep mode was asked to run on memsaver" in err, err[-3000:]
    assert "cannot be loaded here" in err and "libmemsaver.so preloaded" in err


_BY_NAME = """
import os, sys, types
# The engine's front end, as far as the plugin sees it: EngineArgs.create_engine_config.
front = types.ModuleType("vllm.engine.arg_utils")
class EngineArgs:
    def __init__(self, backend):
        self.backend = backend
    def create_engine_config(self):
        model = types.SimpleNamespace(sleep_mode_backend=self.backend)
        return types.SimpleNamespace(model_config=model)
front.EngineArgs = EngineArgs
sys.modules["vllm.engine.arg_utils"] = front
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.device_allocator.cumem import CuMemAllocator
import memsaver.vllm
EngineArgs("cumem").create_engine_config()
print("cumem:", os.environ.get("MEMSAVER_VLLM"), isinstance(CuMemAllocator.instance, memsaver.vllm.Allocator))
EngineArgs("memsaver").create_engine_config()
print("memsaver:", os.environ.get("MEMSAVER_VLLM"), isinstance(CuMemAllocator.instance, memsaver.vllm.Allocator))
"""


def test_the_backend_name_opts_the_engines_processes_in():
    r = run_child(_BY_NAME)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()[-2:]
    assert lines == ["cumem: None False", "memsaver: 1 True"], r.stdout


def test_a_backend_chosen_after_vllm_allocated_on_its_own_is_an_error(monkeypatch):
    import memsaver.vllm as mv
    from vllm.device_allocator import cumem

    class Busy:
        def get_current_usage(self) -> int:
            return 4 * MiB

    monkeypatch.setattr(cumem.CuMemAllocator, "instance", Busy())
    with pytest.raises(memsaver.MemsaverError, match="set MEMSAVER_VLLM=1 in the environment"):
        mv.install()


# -- the allocator protocol ------------------------------------------------------------------


def test_use_memory_pool_tags_allocations_and_nests(vllm_on_memsaver, pluggable: Pluggable):
    a = vllm_on_memsaver
    with a.use_memory_pool("weights"):
        assert a.current_tag == "weights"
        w = pluggable.malloc(2 * MiB)
        with a.use_memory_pool("kv_cache"):
            kv = pluggable.malloc(4 * MiB)
        with a.use_memory_pool("weights"):  # re-entered
            w2 = pluggable.malloc(2 * MiB)
        assert a.current_tag == "weights"
    with a.use_memory_pool():
        d = pluggable.malloc(2 * MiB)
    assert a.current_tag == "default"
    data = a.pointer_to_data
    assert {p: data[p].tag for p in (w, kv, w2, d)} == {w: "weights", kv: "kv_cache", w2: "weights", d: "default"}
    assert data[kv].handle == (0, 4 * MiB, kv, 0)
    assert a.get_current_usage() == 10 * MiB == mapped(a)
    with pytest.raises(memsaver.InvalidArgumentError):
        with a.use_memory_pool("not a tag"):
            pass
    a.release_pools()
    a.release_pools()  # twice is fine
    for p in (w, kv, w2, d):
        pluggable.free(p)
    assert a.get_current_usage() == 0


def _model(a: Any, pluggable: Pluggable) -> dict[str, int]:
    ptrs = {}
    for tag in ("weights", "kv_cache", "workspace", "runtime"):
        with a.use_memory_pool(tag):
            ptrs[tag] = pluggable.malloc(2 * MiB)
        fill(ptrs[tag], len(tag))
    return ptrs


def _free(ptrs: dict[str, int], pluggable: Pluggable) -> None:
    for p in ptrs.values():
        pluggable.free(p)


def test_level_1_offloads_weights_and_runtime_and_wakes_in_stages(vllm_on_memsaver, pluggable):
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    a = vllm_on_memsaver
    ptrs = _model(a, pluggable)
    free_before = memsaver.device_memory(0)[0]
    CuMemBackend().suspend(level=1)  # vLLM's own backend, on memsaver's allocator
    assert mapped(a) == 0
    assert memsaver.device_memory(0)[0] == free_before + 8 * MiB
    stats = memsaver.stats().tags
    assert {t: stats[t].pinned_backup_bytes for t in ptrs} == {
        "weights": 2 * MiB, "kv_cache": 0, "workspace": 0, "runtime": 2 * MiB}

    # verl's staged wake: weights first (and every tag that cannot wait), then the KV cache.
    a.wake_up(["weights"])
    asleep = {d.tag for d in a.pointer_to_data.values() if d.is_asleep}
    assert asleep == {"kv_cache"}
    assert holds(ptrs["weights"], len("weights")) and holds(ptrs["runtime"], len("runtime"))
    assert memsaver.stats().tags["weights"].backup_bytes == 0, "backups are released on wake"
    a.wake_up(["kv_cache"])
    assert mapped(a) == 8 * MiB
    assert not holds(ptrs["kv_cache"], len("kv_cache")), "discarded"
    _free(ptrs, pluggable)


def test_level_2_discards_the_weights_too(vllm_on_memsaver, pluggable):
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    a = vllm_on_memsaver
    ptrs = _model(a, pluggable)
    backend = CuMemBackend()
    backend.suspend(level=2)
    stats = memsaver.stats().tags
    assert stats["weights"].backup_bytes == 0 and stats["runtime"].pinned_backup_bytes == 2 * MiB
    backend.resume(None)
    assert backend.state() == "RUNNING"
    assert not holds(ptrs["weights"], len("weights")), "level 2: reload the weights"
    assert holds(ptrs["runtime"], len("runtime"))
    assert mapped(a) == 8 * MiB
    _free(ptrs, pluggable)


def test_sleep_keeps_the_policy_of_what_is_already_asleep(vllm_on_memsaver, pluggable):
    a = vllm_on_memsaver
    ptrs = _model(a, pluggable)
    a.sleep(offload_tags=("weights",))
    a.sleep(offload_tags=())  # weights stay offloaded, as with vLLM's allocator
    a.wake_up()
    assert holds(ptrs["weights"], len("weights"))
    a.sleep()  # default: offload the tag "default" only
    a.wake_up()
    assert not holds(ptrs["weights"], len("weights"))
    _free(ptrs, pluggable)


def test_discard_frees_selected_tags_and_leaves_the_rest(vllm_on_memsaver, pluggable):
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    a = vllm_on_memsaver
    ptrs = _model(a, pluggable)
    backend = CuMemBackend()
    backend.discard(("kv_cache",))
    assert backend.state() == "SUSPENDED"
    assert mapped(a) == 6 * MiB
    assert holds(ptrs["weights"], len("weights")), "weights untouched"
    a.discard("no_such_tag")  # as vLLM's allocator: a tag without allocations is nothing to do
    backend.resume(["kv_cache"])
    assert mapped(a) == 8 * MiB
    # A sleep after a discard still keeps the weights.
    a.sleep(offload_tags="weights")
    a.wake_up()
    assert holds(ptrs["weights"], len("weights"))
    _free(ptrs, pluggable)


def test_a_wake_up_out_of_memory_raises_runtime_error_and_can_be_retried(vllm_on_memsaver, pluggable, fake):
    a = vllm_on_memsaver
    ptrs = _model(a, pluggable)
    a.sleep(offload_tags=("weights",))
    fake.fakecuda_fail_create_at(1)
    with pytest.raises(RuntimeError, match="resume ran out of device memory"):
        a.wake_up()
    fake.fakecuda_reset_faults()
    assert mapped(a) < 8 * MiB
    a.wake_up()
    assert mapped(a) == 8 * MiB and holds(ptrs["weights"], len("weights"))
    _free(ptrs, pluggable)


def test_cudagraph_pool_needs_torch_with_cuda(vllm_on_memsaver):
    with pytest.raises(memsaver.MemsaverError, match="cudagraph_pool"):
        with vllm_on_memsaver.cudagraph_pool():
            pass


# -- memsaver's backend ---------------------------------------------------------------------


def test_memsavers_backend_pauses_nccl_with_the_weights(vllm_on_memsaver, pluggable):
    import memsaver.vllm as mv
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackend, SleepModeBackendFactory

    if "memsaver" not in SleepModeBackendFactory._registry:
        mv.register()
    cls = SleepModeBackendFactory.get_backend_class("memsaver")
    assert issubclass(cls, SleepModeBackend)
    assert cls.is_supported() and cls.preserves_communicators() and cls.preserves_graphs_with_communicators()

    class Config:
        sleep_mode_backend = "memsaver"

    backend = SleepModeBackendFactory.create_backend(Config())
    assert backend.state() == "RUNNING"
    a = vllm_on_memsaver
    ptrs = _model(a, pluggable)
    backend.suspend(level=1)
    stats = memsaver.stats().tags
    assert stats["nccl"].paused and stats["weights"].paused
    assert stats["weights"].pinned_backup_bytes == 2 * MiB
    backend.resume(["kv_cache"])
    assert memsaver.stats().tags["nccl"].paused, "nccl wakes with the weights"
    backend.resume(["weights"])
    assert not memsaver.stats().tags["nccl"].paused
    assert backend.state() == "RUNNING"
    assert holds(ptrs["weights"], len("weights")) and mapped(a) == 8 * MiB
    backend.discard(("kv_cache",))
    assert backend.state() == "SUSPENDED" and mapped(a) == 6 * MiB
    backend.resume(None)
    _free(ptrs, pluggable)


_CUMEM = """
import os
from vllm.plugins import load_general_plugins
load_general_plugins()
import memsaver
print(memsaver.hook_mode(), os.environ.get("NCCL_CUMEM_ENABLE"))
"""


def test_nccl_cumem_0_is_overridden_only_where_the_nccl_tag_can_act():
    r = run_child(_CUMEM, MEMSAVER_VLLM="1", NCCL_CUMEM_ENABLE="0", LD_PRELOAD=memsaver.preload_path())
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["preload", "1"]
    assert "NCCL_CUMEM_ENABLE=0 would hide NCCL's memory" in r.stderr
    r = run_child(_CUMEM, MEMSAVER_VLLM="1", NCCL_CUMEM_ENABLE="0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["inprocess", "0"], "without the preload nothing to gain"
    r = run_child(_CUMEM, NCCL_CUMEM_ENABLE="0", LD_PRELOAD=memsaver.preload_path())
    assert r.stdout.split()[-2:] == ["preload", "0"], "not opted in: untouched"
