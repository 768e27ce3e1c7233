"""Device buffers for the integration examples: torch tensors when PyTorch with CUDA is there,
else raw memsaver allocations (so the examples also run on the fake driver in CI)."""

from __future__ import annotations

import memsaver


def buffer(nbytes: int, tag: str, backup: str = "discard") -> object:
    """A device buffer of ``nbytes`` tagged ``tag`` (allocate inside ``memsaver.region``)."""
    try:
        import torch

        if torch.cuda.is_available():
            with memsaver.region(tag, backup=backup):  # type: ignore[arg-type]
                return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except ImportError:
        pass
    from memsaver import _memsaver

    memsaver.register_tag(tag)  # also loads memsaver
    return _memsaver.malloc(nbytes, 0, tag, backup)
