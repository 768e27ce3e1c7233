"""memsaver: pause and resume tagged GPU memory at fixed virtual addresses.

    import memsaver

    with memsaver.region("weights", backup="cpu"):
        model = build_model().cuda()       # contents kept in pinned host memory while paused
    with memsaver.region("kv_cache"):
        kv = torch.empty(...)              # "discard": contents are garbage after resume
    with memsaver.region("optimizer", backup="mmap"):  # or "disk" (memsaver.set_disk_dir)
        opt_state = ...                    # pageable host memory: the RSS drops at resume
    memsaver.pause("kv_cache", "weights")  # device memory released, addresses kept
    ...
    memsaver.resume("weights", "kv_cache")

Memory of a ``discard`` tag holds garbage after resume: use ``backup="cpu"`` (pinned host
memory), ``"mmap"`` (pageable host memory) or ``"disk"`` (a file per allocation in the
directory of ``set_disk_dir``) for anything that must survive. Backups are kept across cycles
unless ``set_retain_backups(False)``. The library is loaded on first use; ``import memsaver``
touches no driver.
Errors are ``MemsaverError`` subclasses whose messages say what to do.
"""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import TYPE_CHECKING

from . import _extension

try:
    # control first: importing it registers its stage runner with _core, to be installed once the
    # library is loaded, so it must be imported before anything can load the library.
    from . import _core, control, timeline
    from ._api import (
        allocations,
        cuda_graph,
        device_memory,
        disable,
        discard,
        group,
        hook_mode,
        nccl_stats,
        pause,
        region,
        register_tag,
        reserve_backups,
        resume,
        retain_backups,
        set_backup_prepare_limit,
        set_disk_dir,
        set_group,
        set_memory_margin,
        set_retain_backups,
        stats,
    )
    from ._core import require_preload
    from ._launch import configure_subprocess, preload_path, ray_runtime_env, subprocess_env
    from ._memsaver import (
        BackupError,
        ControlError,
        DriverError,
        DriverNotLoadedError,
        IncompleteError,
        InvalidArgumentError,
        MemsaverError,
        OutOfMemoryError,
        PauseRefusedError,
        PeerError,
        ProfileError,
        ResumeOutOfMemoryError,
        TagPausedError,
        UnknownPointerError,
        UnknownTagError,
    )
    from ._stats import Allocation, SharedExport, SharedImport, Stats, TagStats, Usage
    from .control import register_callback, serve_control
    from .profile import Profile, ProfileStepError, StageReport, StepReport, load_profile, parse_profile
except ImportError:
    # The compiled extension is missing or does not load (see _extension): the package imports
    # all the same, so that memsaver.vllm, which vLLM imports in each of its processes, can say so
    # itself; every public name then raises the error that says what to install.
    if _extension.ERROR is None:
        raise

__all__ = [
    # regions and pause/resume
    "region",
    "disable",
    "cuda_graph",
    "pause",
    "resume",
    "discard",
    "register_tag",
    "allocations",
    "stats",
    "nccl_stats",
    "set_group",
    "group",
    # backups
    "set_retain_backups",
    "retain_backups",
    "set_disk_dir",
    "set_memory_margin",
    "set_backup_prepare_limit",
    "reserve_backups",
    "Stats",
    "TagStats",
    "Usage",
    "Allocation",
    "SharedExport",
    "SharedImport",
    # hook mode and launching
    "hook_mode",
    "require_preload",
    "preload_path",
    "subprocess_env",
    "configure_subprocess",
    "ray_runtime_env",
    # other processes
    "control",
    "serve_control",
    "register_callback",
    # errors
    "MemsaverError",
    "InvalidArgumentError",
    "UnknownTagError",
    "TagPausedError",
    "UnknownPointerError",
    "OutOfMemoryError",
    "ResumeOutOfMemoryError",
    "DriverError",
    "DriverNotLoadedError",
    "IncompleteError",
    "PeerError",
    "ProfileError",
    "BackupError",
    "ControlError",
    "PauseRefusedError",
    "ProfileStepError",
    # profiles
    "load_profile",
    "parse_profile",
    "Profile",
    "StageReport",
    "StepReport",
    "device_memory",
    "timeline",
]

if _extension.ERROR is None:
    timeline._from_env()
    # Under the preload, what the package installs in libmemsaver.so (the stage runner, the
    # pause guard) is installed now, for a process that only other processes drive.
    _core.bind_if_preloaded()
elif not TYPE_CHECKING:  # (with the extension every public name is defined: none comes here)

    def __getattr__(name: str) -> object:
        if name.startswith("_"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        raise _extension.missing(f"memsaver.{name}") from _extension.ERROR


def _version() -> str:
    try:
        return _metadata.version("memsaver")
    except _metadata.PackageNotFoundError:  # not installed as a distribution (a source checkout)
        return "unknown"


__version__ = _version()
