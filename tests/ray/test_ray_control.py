"""Ray actors driven through memsaver.control on a real local Ray cluster (CPU, fake driver):
`memsaver.ray_runtime_env` gives the actors the preload, the group and control; the driver
pauses and resumes them in stages and reads each one's stats. Run by `make test-ray` (which
installs ray into .venv; no ray there is a failure, never a skip)."""

from __future__ import annotations

import os
import random

import memsaver
import ray
from memsaver import control

MIB = 1 << 20


@ray.remote(num_cpus=0)
class Rollout:
    def __init__(self) -> None:
        from memsaver import _memsaver

        memsaver.stats()  # loads the preloaded libmemsaver.so; MEMSAVER_CONTROL=1 serves
        self.ptrs = [
            _memsaver.malloc(8 * MIB, 0, "weights", "cpu"),
            _memsaver.malloc(16 * MIB, 0, "kv_cache", "discard"),
        ]
        self.synced = 0

        def sync() -> None:
            self.synced += 1

        memsaver.register_callback("sync_weights", sync)

    def info(self) -> tuple[int, str, int]:
        return os.getpid(), memsaver.hook_mode(), memsaver.group()

    def synced_count(self) -> int:
        return self.synced


def test_staged_pause_resume_of_ray_actors(tmp_path):
    group = random.randint(1_000_000, 2_000_000_000)
    state = tmp_path / "fake-cuda"
    state.mkdir()
    env = memsaver.ray_runtime_env(group=group, env_vars={"FAKE_CUDA_DIR": str(state)})
    assert env["env_vars"]["MEMSAVER_CONTROL"] == "1"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actors = [Rollout.options(runtime_env=env).remote() for _ in range(3)]
        infos = ray.get([a.info.remote() for a in actors], timeout=120)
        pids = sorted(p for p, _, _ in infos)
        assert all(mode == "preload" and g == group for _, mode, g in infos), infos
        rollout = control.group(group, timeout=60)
        assert rollout.pids() == pids

        def resident(tag: str) -> set[int]:
            return {s.tags[tag].resident_bytes for s in rollout.stats().values()}

        # Sleep in two stages, then wake in two, each driven from here.
        assert rollout.pause("kv_cache") == pids
        assert resident("kv_cache") == {0} and resident("weights") == {8 * MIB}
        assert rollout.pause("weights") == pids
        assert resident("weights") == {0}
        assert rollout.resume("weights") == pids
        assert resident("weights") == {8 * MIB} and resident("kv_cache") == {0}
        assert rollout.resume("kv_cache") == pids
        assert resident("kv_cache") == {16 * MIB}

        # A profile stage with a callback each actor registered.
        profile = tmp_path / "p.yaml"
        profile.write_text(
            "version: 1\ntags:\n  weights: {backup: cpu}\n  kv_cache: {}\nstages:\n"
            "  sleep:\n    - pause: [kv_cache, weights]\n"
            "  wake:\n    - resume: [weights]\n    - call: sync_weights\n    - resume: [kv_cache]\n"
        )
        rollout.run(profile, "sleep")
        assert resident("weights") == {0}
        reports = rollout.run(profile, "wake")
        assert sorted(reports) == pids
        assert ray.get([a.synced_count.remote() for a in actors], timeout=60) == [1, 1, 1]
        assert resident("weights") == {8 * MIB} and resident("kv_cache") == {16 * MIB}
    finally:
        ray.shutdown()
