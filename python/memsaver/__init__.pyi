"""memsaver: pause and resume tagged GPU memory at fixed virtual addresses."""

import os
from collections.abc import Mapping
from contextlib import _GeneratorContextManager
from typing import Any, Literal

from . import control as control
from . import timeline as timeline
from ._memsaver import (
    BackupError,
    ControlError,
    DriverError,
    DriverNotLoadedError,
    IncompleteError,
    InvalidArgumentError,
    MemsaverError,
    OutOfMemoryError,
    PeerError,
    ProfileError,
    ResumeOutOfMemoryError,
    TagPausedError,
    UnknownPointerError,
    UnknownTagError,
)
from ._stats import Stats as Stats
from ._stats import TagStats as TagStats
from ._stats import Usage as Usage
from .control import register_callback as register_callback
from .control import serve_control as serve_control
from .profile import Profile as Profile
from .profile import ProfileStepError as ProfileStepError
from .profile import StageReport as StageReport
from .profile import StepReport as StepReport
from .profile import load_profile as load_profile
from .profile import parse_profile as parse_profile

__version__: str
__all__ = [
    "region",
    "disable",
    "cuda_graph",
    "pause",
    "resume",
    "register_tag",
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
    "Stats",
    "TagStats",
    "Usage",
    "hook_mode",
    "require_preload",
    "preload_path",
    "ray_runtime_env",
    "control",
    "serve_control",
    "register_callback",
    "subprocess_env",
    "configure_subprocess",
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
    "ProfileStepError",
    "load_profile",
    "parse_profile",
    "Profile",
    "StageReport",
    "StepReport",
    "device_memory",
    "timeline",
]

def region(
    tag: str, backup: Literal["discard", "cpu", "mmap", "disk"] = "discard"
) -> _GeneratorContextManager[None]: ...
def disable() -> _GeneratorContextManager[None]: ...
def cuda_graph(
    graph: Any,
    tag: str = "cuda_graph",
    backup: Literal["discard", "cpu", "mmap", "disk"] = "discard",
    **kwargs: Any,
) -> _GeneratorContextManager[None]: ...
def pause(*tags: str) -> None: ...
def resume(*tags: str) -> None: ...
def register_tag(tag: str) -> None: ...
def stats() -> Stats: ...
def nccl_stats() -> dict[str, int | bool | str | None]: ...
def set_group(group: int) -> None: ...
def group() -> int: ...
def hook_mode() -> Literal["preload", "inprocess"]: ...
def require_preload() -> None: ...
def preload_path() -> str: ...
def subprocess_env(environ: Mapping[str, str] | None = None) -> dict[str, str]: ...
def configure_subprocess() -> _GeneratorContextManager[dict[str, str]]: ...
def ray_runtime_env(
    group: int,
    control: bool = True,
    env_vars: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]: ...
def device_memory(device: int = 0) -> tuple[int, int]: ...
def set_retain_backups(on: bool) -> None: ...
def retain_backups() -> bool: ...
def set_disk_dir(path: str | os.PathLike[str] | None) -> None: ...
def set_memory_margin(bytes: int) -> None: ...
def set_backup_prepare_limit(bytes: int) -> None: ...
