"""The public functions of the ``memsaver`` package (re-exported by ``memsaver/__init__.py``):
regions, pause and resume, stats, backup settings and the ``nccl`` group. Each is a thin layer
over the C ABI of libmemsaver.so, reached through the ``_memsaver`` extension; torch is used only
when the application has imported it."""

from __future__ import annotations

import contextlib
import json
import operator
import os
from collections.abc import Iterator
from typing import Any, Literal

from . import _core, _memsaver, _stats, _torch, timeline
from ._memsaver import MemsaverError
from ._stats import Allocation, Stats

Policy = Literal["discard", "cpu", "mmap", "disk"]

# libmemsaver.so calls the pause guard around every pause and resume, those other processes ask
# for included, so that torch never hands out paused memory (_torch.py).
_core.on_load(lambda: _memsaver.set_pause_guard(_torch.pause_guard))


def hook_mode() -> str:
    """How torch reaches memsaver in this process.

    ``"preload"``: the process was started with ``LD_PRELOAD`` of libmemsaver.so, which
    interposes ``cudaMalloc``/``cudaFree`` (and is what NCCL's memory needs).
    ``"inprocess"``: libmemsaver.so was loaded by this package; torch allocates through a
    ``CUDAPluggableAllocator`` pool per tag.
    """
    return _core.hook_mode()


def _tag_names(fn: str, tags: tuple[Any, ...]) -> list[str]:
    for t in tags:
        if not isinstance(t, str):
            raise TypeError(
                f"memsaver.{fn}() takes tag names as separate str arguments, e.g. "
                f"memsaver.{fn}('weights', 'kv_cache'); got {t!r}"
            )
    return list(tags)


@contextlib.contextmanager
def region(tag: str, backup: Policy = "discard") -> Iterator[None]:
    """Tags the device memory allocated on this thread inside the block.

    ``backup``: ``"discard"`` (contents are dropped on pause: garbage after resume),
    ``"cpu"`` (contents kept in pinned host memory while paused), ``"mmap"`` (in pageable
    anonymous host memory: cheap to allocate, and the process RSS drops when it is released) or
    ``"disk"`` (in a file of the disk backup directory, see ``set_disk_dir``). Under PyTorch the
    block's tensors come from a caching-allocator pool of their own (tag, backup, current
    device), so a tag's memory is never reused for another tag's or untagged tensors. Allocate
    tensors for another device inside ``torch.cuda.device(d)``. Regions nest; the innermost one
    applies.
    """
    _core.ensure_loaded()
    torch = _torch.torch_module()
    # A paused tag is refused here (TagPausedError): torch would reuse its unmapped blocks.
    _memsaver.region_enter(tag, backup)
    try:
        if torch is None:
            yield
        else:
            device = torch.cuda.current_device()
            with _torch.scope(torch, _torch.tag_pool(torch, tag, backup, device), device, tag):
                yield
    finally:
        _memsaver.region_exit()


@contextlib.contextmanager
def disable() -> Iterator[None]:
    """Allocations on this thread inside the block are not tagged (never paused), even inside
    a region or in whole-process mode. Under PyTorch they come from torch's default pool, or,
    in whole-process mode (where the default pool holds the process tag's memory, which may be
    paused), from a pool of their own whose cached memory is returned when the block ends."""
    _core.ensure_loaded()
    whole_process = _torch.process_tag() is not None
    _memsaver.region_disable()
    try:
        torch = _torch.torch_module()
        if torch is None:
            yield
        elif not whole_process:
            with _torch.scope(torch, None, -1):
                yield
        else:
            device = torch.cuda.current_device()
            pool = _torch.private_pool(torch, device)
            with _torch.scope(torch, pool, device):
                yield
            # torch frees the pool's unused segments when the pool goes (its cache emptied:
            # with the pause guard's routing lifted, which torch counts as a capture underway).
            with _torch.routing_lifted():
                del pool
    finally:
        _memsaver.region_exit()


@contextlib.contextmanager
def cuda_graph(
    graph: Any,
    tag: str = "cuda_graph",
    backup: Policy = "discard",
    **kwargs: Any,
) -> Iterator[None]:
    """Like ``torch.cuda.graph(graph, **kwargs)``, with the memory of the capture tagged ``tag``
    so that ``pause(tag)`` releases it and the graph replays correctly after ``resume(tag)``.

    ``kwargs`` are those of ``torch.cuda.graph`` (``pool``, ``stream``,
    ``capture_error_mode``). Graphs that share a ``pool`` share memory as with torch.
    """
    torch = _torch.torch_module()
    if torch is None:
        raise MemsaverError(
            "memsaver.cuda_graph needs PyTorch with CUDA available (import torch first)"
        )
    _core.ensure_loaded()
    user_pool = kwargs.pop("pool", None)
    # The capture allocates from the graph's pool: suspend any enclosing region's pool, which
    # torch would otherwise prefer.
    with _torch.scope(torch, None, -1, tag):
        _memsaver.region_enter(tag, backup)
        try:
            pool = _torch.graph_pool(torch, user_pool, tag, backup, graph)
            with torch.cuda.graph(graph, pool=pool, **kwargs):
                yield
        finally:
            _memsaver.region_exit()


def pause(*tags: str, backup: Policy | None = None) -> None:
    """Releases the device memory of ``tags`` (every tag when none is given), keeping their
    virtual addresses. Pausing a paused tag does nothing. An unknown tag raises
    ``UnknownTagError`` listing the known ones.

    ``backup`` chooses the policy now, for every allocation this call pauses, instead of the
    one each was allocated with: ``pause("weights", backup="cpu")`` keeps the weights in pinned
    host memory, ``pause("kv_cache", backup="discard")`` drops the cache (and any backup an
    earlier cycle left). ``resume`` restores what this pause copied. The ``nccl`` tag keeps its
    own backups (``MEMSAVER_NCCL_BACKUP``): naming it with ``backup`` raises
    ``InvalidArgumentError``, and with no tag given it pauses as always. An unknown policy
    raises ``InvalidArgumentError``."""
    names = _tag_names("pause", tags)
    _core.ensure_loaded()
    torch = _torch.cuda_initialized()
    if torch is not None:
        # Kernels queued on torch's streams may still use the memory.
        torch.cuda.synchronize()
    with timeline.span("pause", "pause " + (", ".join(names) or "all"), names):
        if backup is None:
            _memsaver.pause(names)
        else:
            _memsaver.pause(names, backup)


def discard(*tags: str) -> None:
    """Drops the contents of ``tags`` (every tag of allocations when none is given) and their
    backups: resident memory is released without a copy (as ``pause(..., backup="discard")``)
    and paused memory loses its backup, so the next ``resume`` gives memory holding arbitrary
    bytes. The tags are paused afterwards. ``nccl`` cannot be discarded (NCCL needs its
    contents): naming it raises ``InvalidArgumentError``; with no tag given it is left alone."""
    names = _tag_names("discard", tags)
    _core.ensure_loaded()
    torch = _torch.cuda_initialized()
    if torch is not None:
        torch.cuda.synchronize()
    with timeline.span("pause", "discard " + (", ".join(names) or "all"), names):
        _memsaver.discard(names)


def resume(*tags: str, keep_backups: bool | None = None) -> None:
    """Maps device memory again for ``tags`` (every tag when none is given) at the same
    addresses, restoring the contents their pause backed up. Resuming an active tag does
    nothing. Out of memory raises ``ResumeOutOfMemoryError`` (a ``RuntimeError``, as every
    ``MemsaverError``): what was resumed stays resumed; free memory and call resume again.

    ``keep_backups``: ``False`` releases the backups of what this call resumes (and those
    retained by resident allocations of ``tags``), ``True`` keeps them for the next pause,
    ``None`` does as ``set_retain_backups`` says (kept, by default)."""
    names = _tag_names("resume", tags)
    if keep_backups is not None and not isinstance(keep_backups, bool):
        raise TypeError(f"memsaver.resume(keep_backups=...) takes a bool or None, got {keep_backups!r}")
    _core.ensure_loaded()
    with timeline.span("resume", "resume " + (", ".join(names) or "all"), names):
        if keep_backups is None:
            _memsaver.resume(names)
        else:
            _memsaver.resume(names, keep_backups)


def allocations(*tags: str) -> list[Allocation]:
    """The allocations of ``tags`` (every tag when none is given), by address: their size,
    device, tag, state and backup (see ``Allocation``). An unknown tag raises
    ``UnknownTagError``; ``nccl``, which is NCCL's memory rather than allocations, raises
    ``InvalidArgumentError`` (see ``nccl_stats()``)."""
    names = _tag_names("allocations", tags)
    _core.ensure_loaded()
    return _stats.parse_allocations(_memsaver.allocations_json(names))


def register_tag(tag: str) -> None:
    """Declares a tag without allocating, so that it can be paused and is listed in stats."""
    _core.ensure_loaded()
    _memsaver.register_tag(tag)


def stats() -> Stats:
    """Per-tag and total figures of this process (reserved, resident and backup bytes)."""
    _core.ensure_loaded()
    return _stats.parse(_memsaver.stats_json())


def set_group(group: int) -> None:
    """Sets this process's group for the ``nccl`` tag: processes pause and resume NCCL's memory
    together with peers of the same group only, so co-located training and inference
    processes on the same GPUs never mix (also ``MEMSAVER_GROUP``, AMem's ``AMEM_GROUPID`` and
    ``ncclSetGroupID``). Call it before NCCL initialises: once NCCL has shared memory with a
    peer the group is fixed, and another value raises ``InvalidArgumentError``."""
    # int() would turn 3.9 into 3 and True into 1: a group is named exactly or not at all.
    if isinstance(group, bool):
        raise TypeError(f"memsaver.set_group() takes an int, got {group!r}")
    try:
        group = operator.index(group)  # int, or an integer type of another library (numpy)
    except TypeError:
        raise TypeError(f"memsaver.set_group() takes an int, got {group!r}") from None
    _core.ensure_loaded()
    _memsaver.nccl_set_group(group)


def group() -> int:
    """This process's group for the ``nccl`` tag (0 unless set)."""
    _core.ensure_loaded()
    return int(_memsaver.nccl_group())


def nccl_stats() -> dict[str, int | bool | str | dict[str, object] | None]:
    """NCCL's device memory in this process as memsaver's NCCL hook sees it: ``hooked`` (NCCL
    resolved its driver calls through memsaver: the process was started with the preload),
    ``cumem_disabled`` (``NCCL_CUMEM_ENABLE=0``: NCCL then uses cudaMalloc and legacy IPC, which
    no VMM hook sees), bytes and handles NCCL owns, imported from peers and exported, and what
    stays resident (host, FABRIC, NIC ranges, multicast objects). While ``nccl`` is paused,
    also the kernel stack's local memory: ``stack_lowered_bytes`` (freed by lowering the
    per-thread stack limit NCCL's kernels raised), ``stack_kept_bytes`` and
    ``stack_kept_reason`` (kept above CUDA's default because a live CUDA graph or the
    application needs it, e.g. ``"device 0: a live CUDA graph was instantiated at 1744
    B/thread"``; ``None`` when nothing was kept). ``fallback_exports`` and ``fallback_reason``:
    NCCL exports handed out as plain fds because memsaver could not serve its peers (for
    example an unsafe runtime directory; see docs/security.md), which stay resident on pause,
    and why (``None`` when none did). ``runs``: physical allocations a resume made for several
    adjacent buffers each (see docs/nccl.md), and ``freed_held_bytes``: buffers NCCL freed inside
    one, whose memory goes back to the device with the run at the next pause.
    ``chunk_spare_bytes``: memory chunks (``MEMSAVER_NCCL_CHUNK_MB``) hold ahead of NCCL, not
    carved into buffers yet.
    ``bytes_copied_per_pause`` and ``bytes_copied_per_resume``: what the last pause copied to
    backups and the last resume back (only the blocks that hold something, where packed:
    ``MEMSAVER_PACK``).
    ``application``: memory the application took from ``ncclMemAlloc`` (torch's NCCL pools and
    symmetric memory, vLLM's and SGLang's NCCL allocators), which is not NCCL's and not in the
    figures above: ``allocations``, ``bytes``, ``tagged_bytes`` (per tag: memsaver memory of
    the region or process tag it was allocated in) and ``untagged_bytes`` (allocated outside
    any region: resident)."""

    _core.ensure_loaded()
    result: dict[str, int | bool | str | dict[str, object] | None] = json.loads(
        _memsaver.nccl_stats_json()
    )
    return result


def device_memory(device: int = 0) -> tuple[int, int]:
    """(free, total) bytes of ``device`` as the CUDA driver reports them (all processes)."""
    _core.ensure_loaded()
    return _memsaver.device_memory(device)


def set_retain_backups(on: bool) -> None:
    """Backup retention (``MEMSAVER_RETAIN_BACKUP``, default on). On: a backup (host memory or
    disk file) stays attached to its allocation after resume, so later pauses allocate nothing.
    Off: it is released as soon as its allocation has resumed (the host memory or file is given
    back), and the next resume also releases retained backups of resident allocations of the
    tags it names. Backups are always released when their allocation is freed."""
    _core.ensure_loaded()
    _memsaver.set_retain_backups(bool(on))


def retain_backups() -> bool:
    """Whether backups are retained across cycles (see ``set_retain_backups``)."""
    _core.ensure_loaded()
    return bool(_memsaver.retain_backups())


def set_disk_dir(path: str | os.PathLike[str] | None) -> None:
    """Sets the directory of ``backup="disk"`` files (``MEMSAVER_DISK_DIR``), creating it with
    mode 0700 if missing; ``None`` unsets it. An existing directory must be this user's and not
    writable by group or others (else ``InvalidArgumentError`` naming its owner and mode).
    Pausing a disk-backed tag without one raises ``InvalidArgumentError`` and changes nothing.
    Files are private (0600), named by process, checked on resume (a file changed after the
    pause fails the resume and the tag stays paused), and removed when released, at exit, and,
    for processes that died, by the next process that sets the directory (docs/security.md)."""
    _core.ensure_loaded()
    _memsaver.set_disk_dir(None if path is None else os.fspath(path))


def set_backup_prepare_limit(bytes: int) -> None:
    """With retention on, the pinned backup of a ``backup="cpu"`` allocation is allocated on a
    background thread when the allocation is made, so that its first pause only copies
    (allocating pinned memory takes about 0.35-0.65 s per GiB). At most ``bytes`` of host memory are
    held that way (``MEMSAVER_BACKUP_PREPARE_MB``, default: no limit; ``stats().total``
    reports them as ``prepared_backup_bytes``). 0 turns it off for allocations made from now
    on; buffers already prepared stay."""
    if isinstance(bytes, bool) or int(bytes) < 0:
        raise ValueError(f"memsaver.set_backup_prepare_limit() takes a byte count >= 0, got {bytes!r}")
    _core.ensure_loaded()
    _memsaver.set_backup_prepare_limit(int(bytes))


def reserve_backups(bytes: int) -> None:
    """Keeps ``bytes`` of pinned host memory (rounded up to 2 MiB) that the pinned backups of
    ``backup="cpu"`` allocations are carved from at once (``MEMSAVER_BACKUP_RESERVE_MB``, default
    0). A background thread maps and pins it in 16 MiB steps, starting now in the current
    device's context (or once memsaver first uses a device), so that it overlaps with loading
    the model: a first pause right after allocating then copies into pinned memory only, at the
    speed of a later pause. Call it before allocating; ``stats()`` reports
    ``backup_reserve_bytes``, ``backup_reserve_pinned_bytes`` and ``backup_reserve_used_bytes``.
    Backups released (retention off, or freed) go back to it; backups beyond it are prepared
    as ``set_backup_prepare_limit`` says, which does not count the reserve. A smaller value
    releases the free part beyond it; 0 releases all that is free. More than the host's memory
    raises ``InvalidArgumentError``; a reserve the host cannot pin whole keeps what it got (a
    warning in memsaver's log)."""
    if isinstance(bytes, bool) or not isinstance(bytes, int) or bytes < 0 or bytes >= 2**64:
        raise ValueError(
            f"memsaver.reserve_backups() takes a byte count from 0 to this host's memory, got {bytes!r}"
        )
    _core.ensure_loaded()
    _memsaver.reserve_backups(bytes)


def set_memory_margin(bytes: int) -> None:
    """Resume keeps at least ``bytes`` free on each device (``MEMSAVER_MEMORY_MARGIN_MB``,
    default 0): an allocation that would leave less stays paused and resume raises
    ``ResumeOutOfMemoryError`` (what was resumed stays resumed)."""
    _core.ensure_loaded()
    _memsaver.set_memory_margin(int(bytes))
