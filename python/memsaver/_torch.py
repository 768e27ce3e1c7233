"""PyTorch integration: which caching-allocator pool a region's tensors come from.

torch's caching allocator keeps freed blocks and hands them to the next allocation of a
fitting size. If a block of tag A could be reused by a tensor of tag B, pausing A would unmap
memory that B's tensor uses (torch_memory_saver issue #85). So every region allocates from a
``torch.cuda.MemPool`` of its own (tag, policy, device):

* preload mode: a plain ``MemPool()``. Its segments come from ``cudaMalloc``, which
  libmemsaver.so interposes; the region on the calling thread gives them their tag.
* in-process mode (and preload with expandable segments, whose memory does not come from
  ``cudaMalloc``): a ``MemPool`` over ``CUDAPluggableAllocator(libmemsaver.so,
  "memsaver_torch_malloc", "memsaver_torch_free")``, which allocates for the calling thread's
  region. Sharing such a pool's tensors with another process (CUDA IPC) raises a
  ``MemsaverError`` that says to use the preload (see ``_guard_cuda_ipc``).

torch routes an allocation to the *first* active pool whose filter matches (its
``captures_underway`` list), so nested ``use_mem_pool`` blocks on one thread do not work: the
outer pool wins, and entering the same pool twice is an error. This module therefore keeps a
per-thread stack of memsaver's scopes and keeps only the innermost one's pool active, ending
the outer one's while an inner scope is open and starting it again after.

**No allocation lands on paused memory.** torch hands a freed block to the next tensor of a
fitting size without calling ``cudaMalloc``, so a block cached inside a paused allocation would
be handed out and the kernel that uses it would fault (and lose the CUDA context). The pause
guard (``pause_guard``, installed in libmemsaver.so, which calls it under its transition lock
before every pause and after every pause or resume, those other processes ask for included)
makes sure no pool holding paused memory serves an allocation:

* whole-process mode: torch's default pool holds the process tag's memory. While that tag is
  paused, every allocation on its devices is routed to a fresh pool (``_side_pools``); its
  segments come from ``cudaMalloc`` and are resident (the process tag accepts allocations while
  paused). Blocks freed meanwhile go back to the default pool, which serves nothing until the
  resume. The fresh pool is released at the resume; its tensors stay valid, and torch frees its
  segments once they are all free. torch gives a thread's own pool (``use_mem_pool``: regions,
  ``disable()``) and graph captures precedence over this routing, so they keep their pools.
  torch counts the routing as a graph capture underway, and emptying a cache while one is
  underway fails its internal assert (``captures_underway.empty()``): ``torch.cuda.empty_cache()``
  and the release of a ``MemPool`` (``disable()``'s) lift the routing for their call
  (``routing_lifted``).
* torch's cuBLAS workspaces (one per stream, kept from the stream's first matmul, from the pool
  in use then: in whole-process mode, the process tag's memory) are dropped before a pause of
  the process tag, and made again by the next matmul.
* regions: a region's pool holds its tag's memory only and serves only allocations inside a
  region of that tag. Entering a region of a paused tag is refused (``TagPausedError``), and a
  pause of a tag whose region is open (on any thread) is refused (``PauseRefusedError``) before
  anything changes: the region would allocate from paused blocks.

Nothing here imports torch: it is used only when the application has imported it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from . import _core, _memsaver, _stats

_LIB_MALLOC = "memsaver_torch_malloc"
_LIB_FREE = "memsaver_torch_free"

# Guards the creation of _pools and _graph_pools entries and of _allocator, and the
# installation of the CUDA IPC guard (reads of a filled entry need no lock). Reentrant:
# creating a pool creates the allocator.
_lock = threading.RLock()
# (tag, policy, device, kind) -> MemPool. Kept for the life of the process: a pool's cached
# blocks belong to its tag.
_pools: dict[tuple[str, str, int, str], Any] = {}
# Pools for graph captures that name a shared pool, by (user pool id, tag, policy, device).
_graph_pools: dict[tuple[Any, str, str, int], Any] = {}
# Private pools of captures without a pool, kept alive when the graph object cannot hold them.
_graph_pool_refs: list[Any] = []
_allocator: Any = None


def torch_module() -> Any:
    """The torch module if the application imported it and CUDA is usable, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # a broken or CPU-only build: memsaver works without torch
        return None


def cuda_initialized() -> Any:
    """The torch module if it is imported and has initialised CUDA in this process."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_initialized() else None
    except Exception:
        return None


def _expandable_segments() -> bool:
    conf = ",".join(
        os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def pool_kind() -> str:
    """``"plain"`` (segments from the interposed cudaMalloc) or ``"pluggable"``."""
    mode, _ = _core.library()
    return "plain" if mode == "preload" and not _expandable_segments() else "pluggable"


def _pluggable_allocator(torch: Any) -> Any:
    """The process's one ``CUDAPluggableAllocator`` over libmemsaver.so. In in-process mode,
    where it is how torch reaches memsaver, it also installs the CUDA IPC guard."""
    global _allocator
    with _lock:
        if _allocator is None:
            mode, path = _core.library()
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(path, _LIB_MALLOC, _LIB_FREE)
            if mode == "inprocess":
                _guard_cuda_ipc(torch)
        return _allocator


# The attribute of the guard's wrapper that holds the method it wraps: its mark, so that it is
# installed once however often the allocator is made (tests make it again).
_GUARD_ORIGINAL = "_memsaver_original"


def _guard_cuda_ipc(torch: Any) -> None:
    """Has sharing memsaver memory with another process raise ``MemsaverError`` in in-process
    mode, instead of failing in libcudart with an opaque ``cudaErrorInvalidValue``.

    torch shares a CUDA tensor (``torch.multiprocessing`` queues, ``reduce_tensor``) through
    ``storage._share_cuda_()`` (``TypedStorage._share_cuda_`` calls its untyped storage's),
    which asks libcudart's ``cudaIpcGetMemHandle`` for a handle. Under the preload,
    libmemsaver.so interposes that function and shares memsaver memory through handles of its
    own; in in-process mode nothing interposes it, and the runtime cannot export memory it did
    not allocate. ``_share_cuda_`` is a method of the C class ``torch._C.StorageBase``, whose
    Python subclass ``torch.UntypedStorage`` takes the wrapper as an attribute: storages that
    are not memsaver memory go to the original method unchanged. Idempotent; called with
    ``_lock`` held, and never under the preload (the interposed functions serve it there).
    """
    cls: Any = getattr(torch, "UntypedStorage", None)
    original = getattr(cls, "_share_cuda_", None)
    if original is None or getattr(original, _GUARD_ORIGINAL, None) is not None:
        return  # a torch without it, or guarded already

    @functools.wraps(original)
    def _share_cuda_(self: Any, *args: Any, **kwargs: Any) -> Any:
        ptr = int(self.data_ptr())
        allocation = _allocation_at(ptr)
        if allocation is not None:
            raise _memsaver.MemsaverError(_ipc_in_process_message(ptr, allocation))
        return original(self, *args, **kwargs)

    setattr(_share_cuda_, _GUARD_ORIGINAL, original)
    cls._share_cuda_ = _share_cuda_


def _allocation_at(ptr: int) -> _stats.Allocation | None:
    """The memsaver allocation that holds the device address ``ptr``, if any. The C ABI has no
    lookup by address, so this reads the whole list (``memsaver.allocations()``): a cost paid
    once per tensor shared, which torch's own export outweighs."""
    if not ptr:
        return None
    for a in _stats.parse_allocations(_memsaver.allocations_json([])):
        if a.ptr <= ptr < a.ptr + a.size:
            return a
    return None


def _ipc_in_process_message(ptr: int, allocation: _stats.Allocation) -> str:
    """Why a storage at ``ptr`` in ``allocation`` cannot be shared here, and what to do."""
    return (
        f"memsaver: cannot share this CUDA tensor with another process: its memory ({ptr:#x}) is "
        f"memsaver memory of tag '{allocation.tag}' (an allocation of {allocation.size} bytes at "
        f"{allocation.ptr:#x}), and this process runs memsaver in in-process mode (libmemsaver.so "
        "loaded by the package, not preloaded), where CUDA IPC (torch.multiprocessing, "
        "reduce_tensor) cannot export it: libcudart's cudaIpcGetMemHandle exports cudaMalloc "
        "memory only, and nothing here hands it memsaver's. Start this process and the processes "
        "that receive its tensors under the preload: "
        f"LD_PRELOAD={_core.BUNDLED_LIBRARY} (what `python3 -m memsaver preload-path` prints), "
        '`eval "$(python3 -m memsaver env)"` in the shell that launches them, or '
        "env=memsaver.subprocess_env() when starting them from Python; children that "
        "torch.multiprocessing spawns inherit it. Tensors allocated outside memsaver regions are "
        "shared as usual."
    )


def _new_pool(torch: Any, kind: str, device: int) -> Any:
    # A MemPool belongs to the device that is current when it is created.
    with torch.cuda.device(device):
        if kind == "plain":
            return torch.cuda.MemPool()
        return torch.cuda.MemPool(_pluggable_allocator(torch).allocator())


def new_pool(torch: Any, device: int) -> Any:
    """A fresh pool of the kind this process's tagged memory comes from (see ``pool_kind``),
    for a caller that keeps pools of its own (``memsaver.vllm``: one per block, as vLLM's)."""
    return _new_pool(torch, pool_kind(), device)


def private_pool(torch: Any, device: int) -> Any:
    """A fresh pool over torch's own allocator (``cudaMalloc`` outside any region), for a
    ``disable()`` block in whole-process mode."""
    with torch.cuda.device(device):
        return torch.cuda.MemPool()


def tag_pool(torch: Any, tag: str, policy: str, device: int) -> Any:
    """The pool of (tag, policy, device), created on first use."""
    key = (tag, policy, device, pool_kind())
    pool = _pools.get(key)
    if pool is None:
        with _lock:
            pool = _pools.get(key)
            if pool is None:
                pool = _pools[key] = _new_pool(torch, key[3], device)
    return pool


class _Scope:
    """One open memsaver scope of a thread: the pool it allocates from (None: torch's default
    pool), the tag its memory has (None: untagged), the thread, and, while it is the innermost
    scope, the active ``use_mem_pool`` context."""

    __slots__ = ("pool", "device", "tag", "thread", "active")

    def __init__(self, pool: Any, device: int, tag: str | None) -> None:
        self.pool = pool
        self.device = device
        self.tag = tag
        self.thread = threading.current_thread().name
        self.active: Any = None

    def start(self, torch: Any) -> None:
        if self.pool is not None and self.active is None:
            cm = torch.cuda.use_mem_pool(self.pool, self.device)
            cm.__enter__()
            self.active = cm

    def stop(self) -> None:
        cm, self.active = self.active, None
        if cm is not None:
            cm.__exit__(None, None, None)


class _Stack(threading.local):
    def __init__(self) -> None:
        self.scopes: list[_Scope] = []


_stack = _Stack()
# Every open scope with a tag, of every thread (the pause guard reads them), by id.
_tagged_scopes: dict[int, _Scope] = {}
_tagged_lock = threading.Lock()


@contextlib.contextmanager
def scope(torch: Any, pool: Any, device: int, tag: str | None = None) -> Iterator[None]:
    """Allocates from ``pool`` (None: torch's default pool, i.e. untagged) on this thread until
    the block ends, suspending the enclosing memsaver scope's pool meanwhile. ``tag``: the tag
    of what is allocated in the block (a pause of it is refused until the block ends)."""
    scopes = _stack.scopes
    outer = scopes[-1] if scopes else None
    if outer is not None:
        outer.stop()
    s = _Scope(pool, device, tag)
    scopes.append(s)
    if tag is not None:
        with _tagged_lock:
            _tagged_scopes[id(s)] = s
    try:
        s.start(torch)
        yield
    finally:
        if tag is not None:
            with _tagged_lock:
                del _tagged_scopes[id(s)]
        scopes.pop()
        s.stop()
        if outer is not None:
            outer.start(torch)


# Device -> the pool every allocation on it is routed to while the process tag is paused.
# Written by the pause guard only, which libmemsaver.so calls under its transition lock.
_side_pools: dict[int, Any] = {}


def pause_guard(event: int, tags: list[str] | None) -> str | None:
    """libmemsaver.so's pause guard (``memsaver_set_pause_guard``): ``event`` 0 before a pause
    of ``tags`` (None, or a refusal message), 1 after every pause or resume. See the module
    documentation."""
    if event == 0:
        return _before_pause(tags or [])
    _after_transition()
    return None


def _before_pause(tags: list[str]) -> str | None:
    with _tagged_lock:
        open_scopes = [s for s in _tagged_scopes.values() if s.tag in tags]
    if open_scopes:
        s = open_scopes[0]
        return (
            f"a memsaver region of tag '{s.tag}' is open on thread '{s.thread}' "
            f"({len(open_scopes)} open region(s) of the tags this pause names): torch would give "
            "the tensors allocated inside it blocks of the paused memory. Pause the tag after "
            "the region's block has ended"
        )
    torch = cuda_initialized()
    tag = process_tag()
    if torch is None or tag not in tags:
        return None
    # torch keeps a cuBLAS workspace per (handle, stream), allocated at the stream's first matmul
    # from torch's default pool: the process tag's memory. Dropped, they are made again by the
    # next matmul, from the pool allocations are routed to. Only here: a CUDA graph captured with
    # a matmul keeps using the workspace of its capture, which dropping it would free, so a pause
    # of region tags (whose graphs replay while others are paused) leaves them alone.
    torch_c = getattr(torch, "_C", None)
    clear_workspaces = getattr(torch_c, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    devices = {a.device for a in _stats.parse_allocations(_memsaver.allocations_json([tag]))}
    begin = getattr(torch_c, "_cuda_beginAllocateToPool", None)
    if begin is None:
        return (
            f"this PyTorch ({torch.__version__}) cannot route allocations to another pool "
            f"(torch._C._cuda_beginAllocateToPool), so its cached blocks of the process tag "
            f"'{tag}' would be handed out while paused: use PyTorch 2.5 or later"
        )
    _guard_empty_cache(torch)
    for device in sorted(devices - _side_pools.keys()):
        with torch.cuda.device(device):
            pool = torch.cuda.MemPool()
        begin(device, pool.id)
        _side_pools[device] = pool
    return None


@contextlib.contextmanager
def routing_lifted() -> Iterator[None]:
    """The pause guard's routing (``_side_pools``) lifted for the block, and put back after it.
    torch counts a routing as a graph capture underway, and emptying a cache while one is
    underway fails an internal assert that aborts the process: wrap the one call that empties a
    cache (``torch.cuda.empty_cache()``, the release of a ``MemPool``). An allocation that
    another thread makes during that call may come from the default pool."""
    routed = list(_side_pools.items())
    if not routed:
        yield
        return
    torch_c = sys.modules["torch"]._C
    for device, pool in routed:
        torch_c._cuda_endAllocateToPool(device, pool.id)
    try:
        yield
    finally:
        for device, pool in routed:
            torch_c._cuda_beginAllocateToPool(device, pool.id)


def _guard_empty_cache(torch: Any) -> None:
    """Makes ``torch.cuda.empty_cache()`` (verl and others call it right after a pause) lift the
    routing for its call (``routing_lifted``); once per process."""
    original = torch.cuda.empty_cache
    if getattr(original, "__memsaver__", False):
        return

    @functools.wraps(original)
    def empty_cache() -> None:
        with routing_lifted():
            original()

    empty_cache.__memsaver__ = True  # type: ignore[attr-defined]
    torch.cuda.empty_cache = empty_cache
    memory = getattr(torch.cuda, "memory", None)
    if memory is not None and getattr(memory, "empty_cache", None) is original:
        memory.empty_cache = empty_cache


def _after_transition() -> None:
    if not _side_pools:  # nothing routed: nothing to read
        return
    tag = process_tag()
    if tag is None:
        return
    allocations = _stats.parse_allocations(_memsaver.allocations_json([tag]))
    still_paused = {a.device for a in allocations if a.state != "resident"}
    torch = sys.modules["torch"]
    for device in sorted(_side_pools.keys() - still_paused):
        pool = _side_pools.pop(device)
        torch._C._cuda_endAllocateToPool(device, pool.id)
        # Dropping the pool releases it: torch frees its segments once their blocks are free.
        del pool


def process_tag() -> str | None:
    """The whole-process tag (``MEMSAVER_PROCESS_TAG``, ``TMS_INIT_ENABLE``), or None."""
    tag: str | None = json.loads(_memsaver.region_current_json())["process_tag"]
    return tag


def graph_pool(torch: Any, user_pool: Any, tag: str, policy: str, graph: Any) -> Any:
    """The ``pool`` to give ``torch.cuda.graph`` so that the capture's memory is tagged.

    With plain pools, the user's pool (or None: a private pool per graph) works as is, since
    the interposed cudaMalloc sees the region. With the pluggable allocator the capture must
    allocate from a MemPool over libmemsaver.so: a fresh one per graph, or, when the user
    shares a pool between graphs, one memsaver pool per shared pool (same sharing).
    """
    if pool_kind() == "plain":
        return user_pool
    device = torch.cuda.current_device()
    if user_pool is None:
        pool = _new_pool(torch, "pluggable", device)
        try:
            # The graph uses the pool's id; keep the MemPool object alive as long as the graph.
            graph._memsaver_pool = pool
        except AttributeError:
            _graph_pool_refs.append(pool)
        return pool.id
    pool_id = getattr(user_pool, "id", user_pool)  # a MemPool or a pool handle
    key = (tuple(pool_id), tag, policy, device)
    with _lock:
        pool = _graph_pools.get(key)
        if pool is None:
            pool = _graph_pools[key] = _new_pool(torch, "pluggable", device)
    return pool.id
