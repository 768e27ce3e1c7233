"""verl: replace the rollout engine's sleep/wake hooks with a memsaver profile.

verl's hybrid engine puts the rollout (vLLM/SGLang) to sleep before the actor's training step
and wakes it afterwards. With memsaver the two hooks become two profile stages, and the wake is
multi-stage: NCCL and the weights first, the weight sync, then the KV cache, so the peak memory
during the sync does not include the KV cache (docs/profiles.md).
"""

from __future__ import annotations

import pathlib

import memsaver
from _alloc import buffer

PROFILE = pathlib.Path(__file__).resolve().parents[1] / "verl_grpo.yaml"


class RolloutSleepWake:
    """Drop-in for a rollout's ``sleep()`` / ``wake_up()`` pair."""

    def __init__(self, profile_path: str = str(PROFILE)) -> None:
        self.profile = memsaver.load_profile(profile_path)

    def sleep(self) -> memsaver.StageReport:
        return self.profile.run("sleep")

    def wake_up(self, sync_weights) -> memsaver.StageReport:
        return self.profile.run("wake", callbacks={"sync_weights": sync_weights})


def main() -> None:
    hooks = RolloutSleepWake()
    # The rollout engine allocates its weights, KV cache and graphs in the profile's regions.
    weights = buffer(64 << 20, "weights", hooks.profile.tags["weights"])
    kv = buffer(256 << 20, "kv_cache", hooks.profile.tags["kv_cache"])
    for step in range(2):
        print(hooks.sleep())
        # ... the actor trains here, with the rollout's memory released ...
        synced = []
        print(hooks.wake_up(lambda: synced.append(memsaver.stats().tags["kv_cache"].paused)))
        assert synced == [True], "weights are synced while the KV cache is still asleep"
    del weights, kv
    print("verl example: ok")


if __name__ == "__main__":
    main()
