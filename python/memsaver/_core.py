"""Loading libmemsaver.so, once per process, and the hook mode it runs in.

One process has one allocator state, the one inside libmemsaver.so. If the process was started
with ``LD_PRELOAD=.../libmemsaver.so``, the extension uses that copy ("preload" mode: torch's
``cudaMalloc`` is interposed). Otherwise it loads the copy bundled in this package, privately
("inprocess" mode: torch reaches memsaver through ``CUDAPluggableAllocator``). The library is
loaded on first use, not at import, so that ``import memsaver`` never touches the driver.

This module imports no other module of the package but the extension: every other one loads the
library through it. What a module above must do once the library is loaded (memsaver.control
installs its stage runner) it registers here with :func:`on_load`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from . import _memsaver

#: The libmemsaver.so bundled in this package: what ``LD_PRELOAD`` should name.
BUNDLED_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmemsaver.so")

#: Environment variable that states the hook mode a process must run in.
HOOK_MODE_ENV = "MEMSAVER_HOOK_MODE"
_HOOK_MODES = ("auto", "preload", "inprocess")

_load_lock = threading.Lock()
# Run by library() right after it loads libmemsaver.so (see on_load).
_on_load: list[Callable[[], None]] = []


def ld_preload_entries(value: str) -> list[str]:
    """The libraries an ``LD_PRELOAD`` value names (ld.so splits on ':' and spaces)."""
    return [e for e in value.replace(" ", ":").split(":") if e]


def library() -> tuple[str, str]:
    """Loads libmemsaver.so if needed and returns (mode, path) without checking the mode."""
    loaded = _memsaver.loaded()
    if loaded is None:
        # The extension keeps the first library it loads; the lock only avoids two threads
        # racing to dlopen it.
        with _load_lock:
            loaded = _memsaver.loaded() or _memsaver.load(BUNDLED_LIBRARY)
        # What the modules above need done as soon as the library is loaded (memsaver.control:
        # the runner of profile stages that other processes ask this one to run).
        for fn in list(_on_load):
            fn()
    return loaded


def bind_if_preloaded() -> None:
    """Binds the preloaded libmemsaver.so now, if the process has one, so that what
    :func:`on_load` registered (the stage runner, the pause guard) is installed at import: a
    process driven only by other processes (control requests) may never call memsaver itself.
    Finding the preloaded library touches no driver."""
    if _memsaver.loaded() is None and _memsaver.is_preloaded():
        library()


def on_load(fn: Callable[[], None]) -> None:
    """Has ``fn`` run once libmemsaver.so is loaded: right after :func:`library` loads it, or now
    if it already is. ``fn`` may run more than once (two threads loading at once): make it
    idempotent. For the modules above this one, which it never imports."""
    with _load_lock:
        _on_load.append(fn)
    if _memsaver.loaded() is not None:
        fn()


def ensure_loaded() -> tuple[str, str]:
    """Loads libmemsaver.so and checks the mode ``MEMSAVER_HOOK_MODE`` asks for."""
    loaded = library()
    requested = os.environ.get(HOOK_MODE_ENV, "").strip().lower() or "auto"
    if requested not in _HOOK_MODES:
        raise _memsaver.MemsaverError(
            f"{HOOK_MODE_ENV}={os.environ[HOOK_MODE_ENV]!r} is not a hook mode; "
            f"use one of: {', '.join(_HOOK_MODES)}"
        )
    if requested == "preload" and loaded[0] != "preload":
        raise _memsaver.MemsaverError(preload_missing_message(f"{HOOK_MODE_ENV}=preload is set"))
    return loaded


def hook_mode() -> str:
    """``"preload"`` or ``"inprocess"`` (loads the library if needed)."""
    return library()[0]


def preload_missing_message(reason: str) -> str:
    """The message for a process that needs the preload and was started without it."""
    current = os.environ.get("LD_PRELOAD", "")
    lines = [
        f"memsaver: this process needs libmemsaver.so preloaded ({reason}), but it was started "
        "without it, so torch's cudaMalloc and NCCL's memory cannot be hooked. Start it with",
        f"    LD_PRELOAD={BUNDLED_LIBRARY} python ...",
        'or run `eval "$(python -m memsaver env)"` in the shell that launches it, or launch it '
        "from Python inside `with memsaver.configure_subprocess():`.",
    ]
    named = [p for p in ld_preload_entries(current) if "libmemsaver" in p]
    if named:
        lines.append(
            f"LD_PRELOAD names {named[0]!r}, but that library is not loaded: check that the "
            "file exists (the dynamic loader printed an error when the process started)."
        )
    else:
        lines.append(f"(LD_PRELOAD is {current!r}; pid {os.getpid()})")
    return "\n".join(lines)


def require_preload() -> None:
    """Raises ``MemsaverError`` unless this process was started with libmemsaver.so preloaded."""
    if library()[0] != "preload":
        raise _memsaver.MemsaverError(preload_missing_message("preload mode was requested"))
