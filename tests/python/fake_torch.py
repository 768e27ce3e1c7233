"""A stand-in for the parts of torch that memsaver's pool scopes use (``torch.cuda``'s
``MemPool``, ``use_mem_pool``, ``device``, ``graph``, ``CUDAPluggableAllocator``), the storages
that CUDA IPC shares (``UntypedStorage``, ``TypedStorage``) and the allocator calls of the pause
guard (``torch._C``'s routing to a pool and its cuBLAS workspaces), recording every call, so that
what memsaver does under torch is checked without torch. The real torch:
tests/gpu/torch_hooks.py, tests/gpu/paused_alloc.py."""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator
from typing import Any


class FakeTorch(types.ModuleType):
    """Put it in ``sys.modules["torch"]``; ``calls`` lists ("pool", name, allocator),
    ("enter", name, device), ("exit", name), ("freed", name), and ("capture", pool id,
    options) / ("captured",) around a graph capture, ("synchronize",), and ("share_cuda",
    data pointer) when a storage reaches torch's own ``_share_cuda_``, ("route", pool id,
    device) / ("unroute", pool id, device) when every allocation of a device is routed to a pool
    and back, ("clear_workspaces",) and ("empty_cache",), in order.

    As torch's caching allocator, it counts each routing (``use_mem_pool``, a routed device)
    as a capture underway, and emptying a cache while one is underway fails its internal assert:
    ``cuda.empty_cache()`` raises torch's ``RuntimeError``, and a ``MemPool`` released then
    records ("assert", "captures_underway.empty()") where torch would abort the process."""

    def __init__(self) -> None:
        super().__init__("torch")
        calls: list[tuple[Any, ...]] = []
        self.calls = calls
        count = [0]
        # torch's captures_underway: every routing active now.
        underway: list[Any] = []
        self.underway = underway

        def released(name: str) -> None:
            if underway:
                calls.append(("assert", "captures_underway.empty()"))
            calls.append(("freed", name))

        def empty_cache() -> None:
            if underway:
                raise RuntimeError(
                    "captures_underway.empty() INTERNAL ASSERT FAILED at "
                    '"/pytorch/c10/cuda/CUDACachingAllocator.cpp"'
                )
            calls.append(("empty_cache",))

        def route(device: Any, pool: Any) -> None:
            underway.append((tuple(pool), device))
            calls.append(("route", pool, device))

        def unroute(device: Any, pool: Any) -> None:
            underway.remove((tuple(pool), device))
            calls.append(("unroute", pool, device))

        class MemPool:
            def __init__(self, allocator: Any = None) -> None:
                count[0] += 1
                self.name = f"pool{count[0]}"
                self.id = (count[0], 0)
                calls.append(("pool", self.name, allocator))
                weakref.finalize(self, released, self.name)

        @contextlib.contextmanager
        def use_mem_pool(pool: MemPool, device: Any = None) -> Iterator[None]:
            calls.append(("enter", pool.name, device))
            underway.append((pool.id, "this thread"))
            try:
                yield
            finally:
                underway.remove((pool.id, "this thread"))
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

        class UntypedStorage:
            """A CUDA storage at ``ptr``. ``_share_cuda_`` stands for the method torch's
            ``UntypedStorage`` inherits from the C class ``torch._C.StorageBase``, which calls
            ``cudaIpcGetMemHandle``; it returns what torch's does (device, handle, size, offset,
            ...), shortened."""

            def __init__(self, ptr: int, nbytes: int = 4096) -> None:
                self.ptr, self.size = ptr, nbytes

            def data_ptr(self) -> int:
                return self.ptr

            def _share_cuda_(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
                calls.append(("share_cuda", self.ptr))
                return (0, b"handle", self.size, 0)

        class TypedStorage:
            """What ``torch.multiprocessing.reductions.reduce_tensor`` shares
            (``tensor._typed_storage()``): as torch's, its ``_share_cuda_`` is its untyped
            storage's."""

            def __init__(self, untyped: UntypedStorage) -> None:
                self._untyped_storage = untyped

            def _share_cuda_(self, *args: Any, **kwargs: Any) -> Any:
                return self._untyped_storage._share_cuda_(*args, **kwargs)

        self._C = types.SimpleNamespace(
            _cuda_beginAllocateToPool=route,
            _cuda_endAllocateToPool=unroute,
            _cuda_clearCublasWorkspaces=lambda: calls.append(("clear_workspaces",)),
        )
        self.UntypedStorage = UntypedStorage
        self.TypedStorage = TypedStorage
        self.cuda = types.SimpleNamespace(
            graph=graph,
            synchronize=lambda: calls.append(("synchronize",)),
            is_available=lambda: True,
            is_initialized=lambda: True,
            current_device=lambda: 0,
            device=lambda d: contextlib.nullcontext(),
            MemPool=MemPool,
            use_mem_pool=use_mem_pool,
            empty_cache=empty_cache,
            memory=types.SimpleNamespace(
                CUDAPluggableAllocator=CUDAPluggableAllocator, empty_cache=empty_cache
            ),
        )
