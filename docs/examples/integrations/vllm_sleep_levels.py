"""vLLM: sleep levels expressed as memsaver policies.

vLLM's ``llm.sleep(level=1)`` offloads the weights to CPU and discards the KV cache;
``level=2`` discards both (weights are reloaded afterwards); ``wake_up(tags=["weights"])``
brings back only the weights (e.g. for a weight sync) before ``wake_up(tags=["kv_cache"])``.
With memsaver the level is the weights' backup policy, chosen when they are allocated, and
wake-up is ``resume`` of the same tags. NCCL's memory can join with the ``nccl`` tag.
"""

from __future__ import annotations

import memsaver
from _alloc import buffer

LEVELS = {1: {"weights": "cpu", "kv_cache": "discard"}, 2: {"weights": "discard", "kv_cache": "discard"}}


class SleepingEngine:
    def __init__(self, level: int) -> None:
        self.policies = LEVELS[level]
        self.weights = buffer(64 << 20, f"weights_l{level}", self.policies["weights"])
        self.kv = buffer(128 << 20, f"kv_cache_l{level}", self.policies["kv_cache"])
        self.tags = [f"weights_l{level}", f"kv_cache_l{level}"]

    def sleep(self) -> None:
        memsaver.pause(*self.tags)

    def wake_up(self, tags: list[str] | None = None) -> None:
        memsaver.resume(*(tags or self.tags))


def main() -> None:
    for level in (1, 2):
        e = SleepingEngine(level)
        e.sleep()
        s = memsaver.stats().tags
        backup = s[e.tags[0]].backup_bytes
        print(f"level {level}: weights backed up in host memory: {backup >> 20} MiB")
        assert (backup > 0) == (level == 1)
        e.wake_up([e.tags[0]])  # weights first (weight sync), then the KV cache
        assert memsaver.stats().tags[e.tags[1]].paused
        e.wake_up()
    print("vllm example: ok")


if __name__ == "__main__":
    main()
