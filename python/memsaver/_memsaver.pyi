"""The compiled extension: thin calls into the C ABI of libmemsaver.so (memsaver.h)."""

__all__ = [
    "load",
    "loaded",
    "pause",
    "resume",
    "stats_json",
    "nccl_stats_json",
    "nccl_set_group",
    "nccl_group",
    "register_tag",
    "region_enter",
    "region_disable",
    "region_exit",
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
    "parse_profile",
    "device_memory",
]

def load(bundled: str) -> tuple[str, str]:
    """Uses the preloaded libmemsaver.so if the process has one ("preload"), else loads
    ``bundled`` ("inprocess"). Returns (mode, path). Later calls return the first result."""

def loaded() -> tuple[str, str] | None:
    """(mode, path) of the loaded library, or None before ``load``."""

def pause(tags: list[str]) -> None:
    """Pauses ``tags`` (every tag when empty). Releases the GIL."""

def resume(tags: list[str]) -> None:
    """Resumes ``tags`` (every tag when empty). Releases the GIL."""

def nccl_stats_json() -> str: ...
def nccl_set_group(group: int) -> None: ...
def nccl_group() -> int: ...
def stats_json() -> str:
    """The stats as JSON: {"tags": [...], "total": {...}}."""

def register_tag(tag: str) -> None: ...
def region_enter(tag: str, policy: str) -> None:
    """Enters a region on the calling thread (policy "discard" or "cpu")."""

def region_disable() -> None:
    """Enters a scope in which allocations on this thread are not tagged."""

def region_exit() -> None:
    """Leaves the innermost region or disabled scope of the calling thread."""

def malloc(size: int, device: int, tag: str, policy: str) -> int:
    """Allocates tagged device memory directly; returns the device address."""

def free(ptr: int) -> None: ...

class MemsaverError(Exception): ...
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

def parse_profile(text: str, file: str) -> str: ...
def device_memory(device: int) -> tuple[int, int]: ...
