"""vLLM: sleep levels as backup policies chosen when pausing.

vLLM's ``llm.sleep(level=1)`` offloads the weights to CPU and discards the KV cache;
``level=2`` discards both (weights are reloaded afterwards); ``wake_up(tags=["weights"])``
brings back only the weights (e.g. for a weight sync) before ``wake_up(tags=["kv_cache"])``.
With memsaver the level is the backup policy each tag is paused with
(``memsaver.pause(tag, backup=...)``), and wake-up is ``resume`` of the same tags, releasing
the host copies as vLLM does (``keep_backups=False``). This is what memsaver's vLLM plugin
(``memsaver.vllm``, ``MEMSAVER_VLLM=1``) does inside vLLM; NCCL's memory can join with the
``nccl`` tag (``--sleep-mode-backend memsaver``).
"""

from __future__ import annotations

import memsaver
from _alloc import buffer

LEVELS = {1: {"weights": "cpu", "kv_cache": "discard"}, 2: {"weights": "discard", "kv_cache": "discard"}}


class SleepingEngine:
    def __init__(self, name: str) -> None:
        # Allocated without a backup: the level decides when the engine sleeps.
        self.tags = {"weights": f"weights_{name}", "kv_cache": f"kv_cache_{name}"}
        self.weights = buffer(64 << 20, self.tags["weights"])
        self.kv = buffer(128 << 20, self.tags["kv_cache"])

    def sleep(self, level: int) -> None:
        for role, policy in LEVELS[level].items():
            memsaver.pause(self.tags[role], backup=policy)  # type: ignore[arg-type]

    def wake_up(self, tags: list[str] | None = None) -> None:
        roles = tags or list(self.tags)
        memsaver.resume(*(self.tags[r] for r in roles), keep_backups=False)


def main() -> None:
    engine = SleepingEngine("example")
    for level in (1, 2):
        engine.sleep(level)
        s = memsaver.stats().tags
        backup = s[engine.tags["weights"]].backup_bytes
        print(f"level {level}: weights backed up in host memory: {backup >> 20} MiB")
        assert (backup > 0) == (level == 1)
        engine.wake_up(["weights"])  # weights first (weight sync), then the KV cache
        assert memsaver.stats().tags[engine.tags["kv_cache"]].paused
        assert memsaver.stats().tags[engine.tags["weights"]].backup_bytes == 0, "released on wake"
        engine.wake_up(["kv_cache"])
    print("vllm example: ok")


if __name__ == "__main__":
    main()
