"""A stand-in for the parts of torch that memsaver's pool scopes use (``torch.cuda``'s
``MemPool``, ``use_mem_pool``, ``device``, ``graph``, ``CUDAPluggableAllocator``), recording every call, so
that what memsaver does under torch is checked without torch. The real torch:
tests/gpu/torch_hooks.py."""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator
from typing import Any


class FakeTorch(types.ModuleType):
    """Put it in ``sys.modules["torch"]``; ``calls`` lists ("pool", name, allocator),
    ("enter", name, device), ("exit", name), ("freed", name), and ("capture", pool id,
    options) / ("captured",) around a graph capture, and ("synchronize",), in order."""

    def __init__(self) -> None:
        super().__init__("torch")
        calls: list[tuple[Any, ...]] = []
        self.calls = calls
        count = [0]

        class MemPool:
            def __init__(self, allocator: Any = None) -> None:
                count[0] += 1
                self.name = f"pool{count[0]}"
                self.id = (count[0], 0)
                calls.append(("pool", self.name, allocator))
                weakref.finalize(self, calls.append, ("freed", self.name))

        @contextlib.contextmanager
        def use_mem_pool(pool: MemPool, device: Any = None) -> Iterator[None]:
            calls.append(("enter", pool.name, device))
            try:
                yield
            finally:
                calls.append(("exit", pool.name))

        class CUDAPluggableAllocator:
            def __init__(self, path: str, malloc: str, free: str) -> None:
                self.functions = (malloc, free)

            def allocator(self) -> str:
                return "memsaver's pluggable allocator"

        @contextlib.contextmanager
        def graph(cuda_graph: Any, pool: Any = None, **kwargs: Any) -> Iterator[None]:
            calls.append(("capture", pool, kwargs))
            yield
            calls.append(("captured",))

        self.cuda = types.SimpleNamespace(
            graph=graph,
            synchronize=lambda: calls.append(("synchronize",)),
            is_available=lambda: True,
            is_initialized=lambda: True,
            current_device=lambda: 0,
            device=lambda d: contextlib.nullcontext(),
            MemPool=MemPool,
            use_mem_pool=use_mem_pool,
            memory=types.SimpleNamespace(CUDAPluggableAllocator=CUDAPluggableAllocator),
        )
