"""The compiled extension: thin calls into the C ABI of libmemsaver.so (memsaver.h)."""

from collections.abc import Callable

__all__ = [
    "load",
    "loaded",
    "is_preloaded",
    "pause",
    "resume",
    "discard",
    "allocations_json",
    "stats_json",
    "nccl_stats_json",
    "nccl_diagnose_json",
    "disk_diagnose_json",
    "status_of",
    "error_from_status",
    "nccl_set_group",
    "nccl_group",
    "register_tag",
    "region_enter",
    "region_disable",
    "region_exit",
    "region_current_json",
    "set_retain_backups",
    "retain_backups",
    "backup_pointer",
    "set_disk_dir",
    "set_memory_margin",
    "set_backup_prepare_limit",
    "reserve_backups",
    "malloc",
    "free",
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
    "parse_profile",
    "load_profile",
    "cli_main",
    "cli_spec",
    "runtime_dir",
    "device_memory",
    "control_serve",
    "control_set_runner",
    "set_pause_guard",
    "control_json",
]

def is_preloaded() -> bool:
    """Whether this process has libmemsaver.so preloaded (loads and starts nothing)."""

def load(bundled: str) -> tuple[str, str]:
    """Uses the preloaded libmemsaver.so if the process has one ("preload"), else loads
    ``bundled`` ("inprocess"). Returns (mode, path). Later calls return the first result."""

def loaded() -> tuple[str, str] | None:
    """(mode, path) of the loaded library, or None before ``load``."""

def pause(tags: list[str], backup: str | None = None) -> None:
    """Pauses ``tags`` (every tag when empty), each allocation as its policy says or as
    ``backup`` (chosen now) says. Releases the GIL."""

def discard(tags: list[str]) -> None:
    """Drops the contents and backups of ``tags`` (every tag of allocations when empty).
    Releases the GIL."""

def resume(tags: list[str], keep_backups: bool | None = None) -> None:
    """Resumes ``tags`` (every tag when empty), keeping or releasing the backups of what it
    resumes (None: the retention setting). Releases the GIL."""

def allocations_json(tags: list[str]) -> str:
    """The allocations of ``tags`` (every tag when empty) as JSON: [{"ptr", "size", "device",
    "tag", "policy", "state", "backup", "backup_bytes"}]."""

def nccl_stats_json() -> str: ...
def nccl_diagnose_json() -> str: ...
def disk_diagnose_json() -> str:
    """The disk backup directory as a pause would find it and the backup files in it (JSON:
    {"dir", "state", "files": [{"name", "pid", "bytes", "running", "own"}]})."""

def status_of(e: BaseException) -> int: ...
def error_from_status(code: int, message: str) -> MemsaverError: ...
def nccl_set_group(group: int) -> None: ...
def nccl_group() -> int: ...
def stats_json() -> str:
    """The stats as JSON: {"tags": [...], "total": {...}}."""

def register_tag(tag: str) -> None: ...
def region_enter(tag: str, policy: str) -> None:
    """Enters a region on the calling thread (policy "discard", "cpu", "mmap" or "disk")."""

def region_disable() -> None:
    """Enters a scope in which allocations on this thread are not tagged."""

def region_exit() -> None:
    """Leaves the innermost region or disabled scope of the calling thread."""

def region_current_json() -> str:
    """What applies to an allocation on this thread now, as JSON: {"tag", "policy", "disabled",
    "process", "depth"} (tag and policy null when allocations are not tagged)."""

def set_retain_backups(on: bool) -> None:
    """Backup retention on (keep backups across cycles) or off (release at resume)."""

def retain_backups() -> bool:
    """Whether backups are retained across cycles."""

def backup_pointer(ptr: int, size: int) -> int:
    """Host address of byte ``ptr`` in the host backup (cpu or mmap) of the allocation holding
    ``[ptr, ptr + size)``, holding the contents as of its last pause; 0 if there is none."""

def set_disk_dir(path: str | None) -> None:
    """Sets (creating it, mode 0700) or unsets the directory of disk backup files; an existing
    one must be this user's and not writable by group or others."""

def set_memory_margin(bytes: int) -> None:
    """Bytes resume keeps free on each device (0: no check)."""

def set_backup_prepare_limit(bytes: int) -> None:
    """The most pinned host memory prepared ahead of first pauses, in bytes (0: none)."""

def reserve_backups(bytes: int) -> None:
    """Keeps this many bytes of pinned host memory for cpu backups, pinned in the background."""

def malloc(size: int, device: int, tag: str, policy: str) -> int:
    """Allocates tagged device memory directly; returns the device address."""

def free(ptr: int) -> None: ...
def control_serve() -> None:
    """Opts this process in to control requests from other processes (its socket starts now)."""

def control_set_runner(runner: Callable[[str], str] | None) -> None:
    """Installs the runner of profile stages for control requests (JSON in, JSON out)."""

def set_pause_guard(guard: Callable[[int, list[str] | None], str | None] | None) -> None:
    """Installs the pause guard: ``guard(0, tags)`` before a pause of ``tags`` returns None or
    a refusal message; ``guard(1, None)`` after every pause or resume. None removes it."""

def control_json(request: str) -> str:
    """Sends a control request (JSON) to other processes; their answers as JSON. Releases the GIL."""

class MemsaverError(RuntimeError): ...
class InvalidArgumentError(MemsaverError): ...
class UnknownTagError(MemsaverError): ...
class TagPausedError(MemsaverError): ...
class UnknownPointerError(MemsaverError): ...
class OutOfMemoryError(MemsaverError): ...
class ResumeOutOfMemoryError(OutOfMemoryError): ...
class DriverError(MemsaverError): ...
class DriverNotLoadedError(MemsaverError): ...
class IncompleteError(MemsaverError): ...
class PeerError(MemsaverError): ...
class ProfileError(MemsaverError): ...
class BackupError(MemsaverError): ...
class ControlError(MemsaverError): ...
class PauseRefusedError(MemsaverError): ...

def parse_profile(text: str, file: str) -> str: ...
def load_profile(path: str) -> str:
    """Reads (at most 1 MiB) and validates the profile file at ``path``; returns its JSON."""

def cli_main(args: list[str]) -> int:
    """Runs a core command of the memsaver command line (demo, bench, options); its exit status."""

def cli_spec() -> str:
    """The core's commands of the command line and their flags, as JSON (their one definition)."""

def runtime_dir() -> str:
    """The runtime directory of the nccl tag's sockets (not created)."""
def device_memory(device: int) -> tuple[int, int]: ...
