"""SGLang (and slime, verl's SGLang rollout): switch from torch_memory_saver with one import.

SGLang's memory saver adapter calls ``torch_memory_saver.region(tag=...)``, ``pause(tag)`` and
``resume(tag)``; memsaver's compat object has the same API, so the change is:

    - from torch_memory_saver import torch_memory_saver
    + from memsaver.compat import torch_memory_saver

Start SGLang under the preload (``eval "$(python -m memsaver env)"``) to tag CUDA graph memory
and to put NCCL's memory under the ``nccl`` tag too.
"""

from __future__ import annotations

import memsaver
from memsaver.compat import torch_memory_saver


def main() -> None:
    # What SGLang's model runner does at start-up (tags as in SGLang).
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        weights = _alloc(32 << 20, "weights", "cpu")
    with torch_memory_saver.region(tag="kv_cache"):
        kv = _alloc(128 << 20, "kv_cache", "discard")
    # release_memory_occupation(tags=["kv_cache", "weights"]) / resume_memory_occupation(...)
    for tag in ("kv_cache", "weights"):
        torch_memory_saver.pause(tag)
    assert memsaver.stats().tags["weights"].resident_bytes == 0
    for tag in ("weights", "kv_cache"):
        torch_memory_saver.resume(tag)
    print(memsaver.stats())
    del weights, kv
    print("sglang example: ok")


def _alloc(nbytes: int, tag: str, backup: str) -> object:
    # Inside torch_memory_saver.region torch tensors would be tagged; without torch (fake
    # driver in CI) allocate the tagged memory directly.
    try:
        import torch

        if torch.cuda.is_available():
            return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except ImportError:
        pass
    from memsaver import _memsaver

    return _memsaver.malloc(nbytes, 0, tag, backup)


if __name__ == "__main__":
    main()
