"""vLLM's sleep mode on memsaver (vLLM 0.33).

vLLM allocates the memory that sleep mode frees through one object, ``CuMemAllocator``'s
singleton (``get_mem_allocator_instance()``): its ``use_memory_pool(tag)`` tags the tensors made
inside it (``weights``, ``kv_cache``, ``workspace``, ``runtime``, ``cudagraph``), ``sleep``,
``wake_up`` and ``discard`` free and restore them. :class:`Allocator` implements the same
protocol on memsaver's tags, and :func:`register`, the ``vllm.general_plugins`` entry point of
memsaver's wheel, makes vLLM use it:

* ``MEMSAVER_VLLM=1`` in the environment of vLLM's processes: ``CuMemAllocator.instance`` and
  ``CuMemAllocator.get_instance`` become memsaver's :class:`Allocator`, so
  ``--enable-sleep-mode`` (and ``--sleep-mode-offload-cudagraph`` for CUDA graphs) runs vLLM's
  sleep levels, ``wake_up(tags)`` and ``discard`` on memsaver's tags, with vLLM's default
  sleep-mode backend (``cumem``).
* ``--sleep-mode-backend memsaver`` (``LLM(..., sleep_mode_backend="memsaver")``): the same,
  opted in by the name (the process that builds the engine's configuration sets
  ``MEMSAVER_VLLM=1`` for the engine's processes), and the sleep-mode backend
  :class:`MemsaverBackend`, which also pauses NCCL's memory (the ``nccl`` tag) with the
  weights and resumes it with them; vLLM's communicators and the CUDA graphs that use them stay
  valid. vLLM 0.33 routes CUDA graph memory to the allocator only for the backend named
  ``cumem``, so with this one graphs stay in torch's own pool (resident).

Without either, the plugin registers the backend's name and does nothing else. Sleep levels map
as ``CuMemAllocator`` maps them: level 1 keeps ``weights``, ``runtime`` and ``cudagraph`` in
pinned host memory and discards the rest, level 2 keeps ``runtime`` and ``cudagraph`` and
discards the weights too; each tag's backup policy is chosen at pause time
(``memsaver.pause(..., backup=...)``), the backups are released when the tag wakes
(``resume(..., keep_backups=False)``), and a wake-up that runs out of device memory raises
``ResumeOutOfMemoryError``, a ``RuntimeError``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import _extension

try:
    from . import _core, _memsaver, _torch
    from ._api import allocations, pause, register_tag, resume
    from ._memsaver import MemsaverError
except ImportError:
    # Without the compiled extension this module still imports, so that register(), vLLM's entry
    # point, says what is missing instead of vLLM's plugin loader logging an import error and
    # running without memsaver; nothing else here works then.
    if _extension.ERROR is None:
        raise

#: The environment variable that opts vLLM's processes in (``1``) or out (``0``, unset).
ENV = "MEMSAVER_VLLM"
#: The sleep-mode backend's name (``--sleep-mode-backend memsaver``).
BACKEND = "memsaver"
#: The tags a selective ``wake_up(tags)`` may leave asleep; it wakes every other tag
#: (vLLM's ``DEFERRABLE_TAGS``).
DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")
#: The tag of CUDA graph memory (``cudagraph_pool()``).
GRAPH_TAG = "cudagraph"

_log = logging.getLogger("memsaver.vllm")


def opted_in() -> bool:
    """Whether ``MEMSAVER_VLLM`` asks for memsaver (``1``/``true``); ``0``, ``false`` or unset
    do not. Another value raises ``MemsaverError`` naming it (options are strict)."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("", "0", "false"):
        return False
    if value.lower() in ("1", "true"):
        return True
    raise MemsaverError(f"{ENV}={value!r}: expected 0 or 1")


@dataclass
class AllocationData:
    """One allocation as vLLM's ``CuMemAllocator.pointer_to_data`` shows it: ``handle`` is
    (device, size, address, 0), ``is_asleep`` whether it is paused. The backup lives in
    memsaver, not in a tensor: ``cpu_backup_tensor`` is always None."""

    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None
    is_asleep: bool = False


class Allocator:
    """vLLM's sleep-mode allocator protocol on memsaver's tags (see the module documentation).

    Memory allocated inside ``use_memory_pool(tag)`` has the memsaver tag ``tag`` and the
    policy ``discard``; ``sleep`` chooses each tag's backup when it pauses it. Every
    ``use_memory_pool`` block allocates from a pool of its own (as vLLM's does), so that a tag's
    freed blocks can be given back: entering a tag again releases the unused memory of its
    older pools (``torch.accelerator.synchronize`` of the device first, then
    ``torch.accelerator.empty_cache``).
    """

    default_tag: str = "default"

    def __init__(self) -> None:
        self.current_tag: str = Allocator.default_tag
        # Tag -> [(pool, device)] of its use_memory_pool blocks, oldest first. Pools with live
        # blocks are kept (torch releases a pool's segments only once nothing refers to it).
        self.allocator_and_pools: dict[str, list[tuple[Any, int]]] = {}
        self._tags: list[str] = []
        self._graph_pools: dict[int, Any] = {}
        self._lock = threading.Lock()

    # -- what vLLM calls -------------------------------------------------------------------

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """Tags the memory allocated on this thread inside the block ``tag`` (default
        ``"default"``). Blocks nest and re-enter; the innermost applies."""
        if tag is None:
            tag = Allocator.default_tag
        if not isinstance(tag, str):
            raise TypeError(f"use_memory_pool() takes a tag name, got {tag!r}")
        self._know(tag)
        restore_conf = _without_expandable_segments()
        old_tag, self.current_tag = self.current_tag, tag
        try:
            if tag != old_tag:
                self._trim(tag)
            with self._region(tag):
                yield
        finally:
            self.current_tag = old_tag
            restore_conf()

    @contextlib.contextmanager
    def cudagraph_pool(self) -> Iterator[Any]:
        """Yields the id of the pool CUDA graphs are captured into (one per device, shared by
        every capture), whose memory has the tag ``cudagraph``; the capture must run inside
        the block."""
        torch = _torch.torch_module()
        if torch is None:
            raise MemsaverError("memsaver.vllm: cudagraph_pool() needs torch with CUDA")
        self._know(GRAPH_TAG)
        device = int(torch.cuda.current_device())
        with self._lock:
            pool = self._graph_pools.get(device)
            if pool is None:
                pool = self._graph_pools[device] = _torch.new_pool(torch, device)
        old_tag, self.current_tag = self.current_tag, GRAPH_TAG
        # The capture allocates from the graph's pool: suspend any enclosing block's pool,
        # which torch would prefer.
        try:
            with _torch.scope(torch, None, -1, GRAPH_TAG):
                _memsaver.region_enter(GRAPH_TAG, "discard")
                try:
                    yield pool.id
                finally:
                    _memsaver.region_exit()
        finally:
            self.current_tag = old_tag

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Pauses every tag: those in ``offload_tags`` (default ``("default",)``) keep their
        contents in pinned host memory, the others are discarded. Tags already asleep keep
        what their pause did."""
        if offload_tags is None:
            offload_tags = (Allocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        tags = self._tags_now()
        keep = [t for t in tags if t in offload_tags]
        drop = [t for t in tags if t not in offload_tags]
        if keep:
            pause(*keep, backup="cpu")
        if drop:
            pause(*drop, backup="discard")
        _log.info("memsaver: vLLM sleep: kept %s in host memory, discarded %s", keep, drop)
        self._empty_cache()

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Releases the memory of ``tags`` without keeping its contents; what is already asleep
        keeps what its pause did (as vLLM's allocator does)."""
        if isinstance(tags, str):
            tags = (tags,)
        named = [t for t in self._tags_now() if t in tags]
        if named:
            pause(*named, backup="discard")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Resumes ``tags`` (every tag when None) and every tag that is not deferrable
        (``weights``, ``kv_cache``), restoring what the sleep kept and then releasing those
        backups. Out of device memory raises ``ResumeOutOfMemoryError`` (a ``RuntimeError``):
        what was resumed stays resumed."""
        self._empty_cache()
        known = self._tags_now()
        if tags is None:
            wake = known
        else:
            wake = [t for t in known if t in tags or t not in DEFERRABLE_TAGS]
        if wake:
            resume(*wake, keep_backups=False)

    def get_current_usage(self) -> int:
        """Bytes of every allocation of the tags this allocator made, asleep or not."""
        return sum(d.handle[1] for d in self.pointer_to_data.values())

    @property
    def pointer_to_data(self) -> dict[int, AllocationData]:
        """The allocations of the tags this allocator made, by address (a fresh view)."""
        tags = self._tags_now()
        if not tags:
            return {}
        return {
            a.ptr: AllocationData(
                (a.device, a.size, a.ptr, 0), a.tag, None, a.state != "resident"
            )
            for a in allocations(*tags)
        }

    def release_pools(self) -> None:
        """Drops this allocator's references to its pools (torch releases their unused
        memory at the next ``empty_cache``; memory still in use stays). Safe to call twice."""
        with self._lock:
            self.allocator_and_pools.clear()
            self._graph_pools.clear()
        gc.collect()

    def close(self) -> None:
        """Same as :meth:`release_pools`."""
        self.release_pools()

    # -- internals -------------------------------------------------------------------------

    def _know(self, tag: str) -> None:
        register_tag(tag)  # also checks the name; a paused tag stays paused
        with self._lock:
            if tag not in self._tags:
                self._tags.append(tag)

    def _tags_now(self) -> list[str]:
        with self._lock:
            return list(self._tags)

    @contextlib.contextmanager
    def _region(self, tag: str) -> Iterator[None]:
        _core.ensure_loaded()
        torch = _torch.torch_module()
        # A paused tag is refused here (TagPausedError): resume it first.
        _memsaver.region_enter(tag, "discard")
        try:
            if torch is None:
                yield
            else:
                device = int(torch.cuda.current_device())
                pool = _torch.new_pool(torch, device)
                with self._lock:
                    self.allocator_and_pools.setdefault(tag, []).append((pool, device))
                with _torch.scope(torch, pool, device, tag):
                    yield
        finally:
            _memsaver.region_exit()

    def _trim(self, tag: str) -> None:
        """Gives back the unused memory of the tag's older pools: those without a live block
        are dropped, then torch empties its cache."""
        torch = _torch.torch_module()
        if torch is None:
            return
        with self._lock:
            pools = self.allocator_and_pools.get(tag, [])
            idle = [(p, d) for p, d in pools if _pool_idle(p)]
            if not idle:
                return
            self.allocator_and_pools[tag] = [e for e in pools if e not in idle]
        devices = sorted({d for _, d in idle})
        del idle, pools
        gc.collect()
        for d in devices:
            # Nothing queued may still use the memory about to be released.
            torch.accelerator.synchronize(d)
        torch.accelerator.empty_cache()

    @staticmethod
    def _empty_cache() -> None:
        gc.collect()
        torch = _torch.cuda_initialized()
        if torch is not None:
            torch.accelerator.empty_cache()


def _pool_idle(pool: Any) -> bool:
    """Whether no block of ``pool`` is in use."""
    try:
        return all(seg.get("allocated_size", 0) == 0 for seg in pool.snapshot())
    except Exception:  # a torch without MemPool.snapshot: keep the pool
        return False


def _without_expandable_segments() -> Any:
    """Turns torch's expandable segments off until the returned function is called, as vLLM's
    allocator does around its pools (torch#147851); a no-op without vLLM or when they are off."""
    try:
        from vllm.device_allocator import alloc_conf
    except ImportError:
        return lambda: None
    prev = alloc_conf.current_alloc_conf()
    if not alloc_conf.conf_flag_enabled(prev, alloc_conf.EXPANDABLE_SEGMENTS):
        return lambda: None
    alloc_conf.set_alloc_conf(alloc_conf.with_conf_flag(prev, alloc_conf.EXPANDABLE_SEGMENTS, False))
    return lambda: alloc_conf.set_alloc_conf(prev)


_instance: Allocator | None = None
_instance_lock = threading.Lock()


def allocator() -> Allocator:
    """The process's one :class:`Allocator`."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = Allocator()
        return _instance


def install() -> Allocator:
    """Makes vLLM's ``CuMemAllocator.get_instance()`` (and so ``get_mem_allocator_instance()``)
    return memsaver's :class:`Allocator`, and ``CuMemAllocator.instance`` be it. Loads
    libmemsaver.so first: a process that cannot load it raises ``MemsaverError`` saying why,
    before vLLM allocates anything. Idempotent."""
    try:
        _core.ensure_loaded()
    except (MemsaverError, OSError) as e:
        raise MemsaverError(
            f"memsaver.vllm: vLLM's sleep mode was asked to run on memsaver ({ENV}=1 or "
            f"--sleep-mode-backend {BACKEND}) in process {os.getpid()}, but memsaver's library "
            f"cannot be loaded here: {e}. Install memsaver into this Python environment "
            f"(pip install memsaver) or unset {ENV}."
        ) from e
    from vllm.device_allocator import cumem

    cls = cumem.CuMemAllocator
    previous = cls.instance
    if previous is not None and not isinstance(previous, Allocator) and previous.get_current_usage():
        raise MemsaverError(
            f"memsaver.vllm: vLLM already allocated {previous.get_current_usage()} bytes through "
            f"its own allocator in process {os.getpid()}, which memsaver cannot pause: set "
            f"{ENV}=1 in the environment of vLLM's worker processes (with Ray: in their "
            "runtime_env) so that the plugin installs memsaver's allocator before vLLM allocates"
        )
    ours = allocator()
    if "_memsaver_original_get_instance" not in cls.__dict__:
        cls._memsaver_original_get_instance = cls.__dict__.get("get_instance")
        cls.get_instance = staticmethod(allocator)
        atexit.register(ours.release_pools)
    cls.instance = ours
    return ours


def uninstall() -> None:
    """Gives vLLM its own allocator back (for tests); memory allocated through memsaver's
    stays memsaver's."""
    from vllm.device_allocator import cumem

    cls = cumem.CuMemAllocator
    if "_memsaver_original_get_instance" in cls.__dict__:
        cls.get_instance = cls.__dict__["_memsaver_original_get_instance"]
        del cls._memsaver_original_get_instance
    if isinstance(cls.instance, Allocator):
        cls.instance = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point, run by vLLM in each of its processes.
    Registers the sleep-mode backend name ``memsaver`` (lazily: nothing is imported or loaded
    for it), and, opted in (``MEMSAVER_VLLM=1``), installs memsaver's allocator. Without the
    variable, a configuration that names the backend opts the engine's processes in.

    Where memsaver's compiled extension does not import, opting in (``MEMSAVER_VLLM`` set to
    anything but ``0``) raises the ``ImportError`` that says so and how to install memsaver, and
    the backend's name, registered all the same, raises it when vLLM makes the backend."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    if BACKEND not in SleepModeBackendFactory._registry:
        SleepModeBackendFactory.register_backend(BACKEND, __name__, "MemsaverBackend")
    if _extension.ERROR is not None:
        value = os.environ.get(ENV, "").strip()
        if value.lower() not in ("", "0", "false"):
            raise _no_extension(f"{ENV}={value}", f"unset {ENV}") from _extension.ERROR
        return
    if opted_in():
        install()
        _let_nccl_use_cumem()
    else:
        _opt_in_by_backend_name()


def _let_nccl_use_cumem() -> None:
    """``NCCL_CUMEM_ENABLE=0`` (verl sets it for its rollout) makes NCCL allocate with
    cudaMalloc and legacy IPC, which no VMM hook sees, so the ``nccl`` tag would pause nothing.
    In a process started with memsaver's preload, where the tag can act, the plugin sets it
    back to 1 before vLLM's worker starts NCCL, and says so (vLLM 0.33 itself leaves it
    alone)."""
    if os.environ.get("NCCL_CUMEM_ENABLE", "").strip() == "0" and _core.hook_mode() == "preload":
        os.environ["NCCL_CUMEM_ENABLE"] = "1"
        _log.warning(
            "memsaver: NCCL_CUMEM_ENABLE=0 would hide NCCL's memory from memsaver's nccl tag; "
            "set to 1 in this vLLM process (pid %d)", os.getpid()
        )


def _opt_in_by_backend_name() -> None:
    """Wraps ``EngineArgs.create_engine_config`` (in the process that builds the engine's
    configuration) so that a configuration naming the backend ``memsaver`` sets
    ``MEMSAVER_VLLM=1`` for this process and the engine and worker processes it starts, and
    installs the allocator here."""
    # vLLM loads plugins there from EngineArgs itself: a process that has not imported it
    # builds no configuration (a worker), and importing it would cost every such process.
    front = sys.modules.get("vllm.engine.arg_utils")
    EngineArgs = getattr(front, "EngineArgs", None)
    if EngineArgs is None:
        return
    create = EngineArgs.create_engine_config
    if getattr(create, "_memsaver_wrapped", False):
        return

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = create(self, *args, **kwargs)
        model = getattr(config, "model_config", None)
        if getattr(model, "sleep_mode_backend", None) == BACKEND:
            os.environ[ENV] = "1"
            install()
        return config

    create_engine_config._memsaver_wrapped = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config


def _no_extension(asked_by: str, instead: str) -> ImportError:
    """The error of a process asked (by ``asked_by``) to run vLLM's sleep mode on memsaver where
    memsaver's extension does not import; ``instead`` is how to run without memsaver."""
    return _extension.missing(
        f"memsaver.vllm: vLLM's sleep mode was asked to run on memsaver ({asked_by}) in process "
        f"{os.getpid()}, but memsaver cannot run here ({instead} to run vLLM without it)"
    )


_backend_class: Any = None


def __getattr__(name: str) -> Any:
    """``MemsaverBackend``, vLLM's ``SleepModeBackend`` subclass, made on first use (it needs
    vLLM, which ``import memsaver.vllm`` does not)."""
    global _backend_class
    if name != "MemsaverBackend":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _extension.ERROR is not None:
        raise _no_extension(
            f"--sleep-mode-backend {BACKEND}", "choose another --sleep-mode-backend"
        ) from _extension.ERROR
    if _backend_class is None:
        _backend_class = _make_backend_class()
    return _backend_class


def _make_backend_class() -> Any:
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

    namespace = {
        "__doc__": _BACKEND_DOC,
        "__module__": __name__,
        "__init__": _backend_init,
        "suspend": _backend_suspend,
        "resume": _backend_resume,
        "discard": _backend_discard,
        "preserves_communicators": classmethod(_true),
        "preserves_graphs_with_communicators": classmethod(_true),
    }
    return type("MemsaverBackend", (SleepModeBackend,), namespace)


_BACKEND_DOC = """vLLM's sleep-mode backend on memsaver (``--sleep-mode-backend memsaver``): the levels of
vLLM's ``cumem`` backend on memsaver's allocator, and NCCL's memory (the ``nccl`` tag) paused
with the weights and resumed with them, so communicators (and the graphs that use them)
survive a sleep."""


def _backend_init(self: Any) -> None:
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

    SleepModeBackend.__init__(self)
    install()


def _backend_suspend(self: Any, level: int = 1) -> None:
    from vllm.device_allocator import get_mem_allocator_instance

    self._state = "SUSPENDED"
    offload: tuple[str, ...] = ("runtime", GRAPH_TAG)
    if level == 1:
        offload = ("weights", *offload)
    get_mem_allocator_instance().sleep(offload_tags=offload)
    pause("nccl")


def _backend_resume(self: Any, tags: list[str] | None = None) -> None:
    from vllm.device_allocator import get_mem_allocator_instance

    self._state = "RESUMING"
    if tags is None or "weights" in tags:
        resume("nccl")
    get_mem_allocator_instance().wake_up(tags)
    self._state = "RUNNING"


def _backend_discard(self: Any, tags: tuple[str, ...]) -> None:
    from vllm.device_allocator import get_mem_allocator_instance

    get_mem_allocator_instance().discard(tags)
    self._state = "SUSPENDED"


def _true(cls: Any) -> bool:
    return True


__all__ = [
    "ENV",
    "BACKEND",
    "DEFERRABLE_TAGS",
    "GRAPH_TAG",
    "AllocationData",
    "Allocator",
    "allocator",
    "install",
    "uninstall",
    "register",
    "opted_in",
]
