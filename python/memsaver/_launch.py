"""What a launcher must pass to the processes it starts so that they run in preload mode.

Launchers lose or mangle ``LD_PRELOAD`` (Ray workers start from the raylet, not from the
driver's shell; ``stdbuf`` and friends overwrite it), so the variables are computed here once
and handed out as a dict, as a context manager over ``os.environ``, and as shell lines
(``python -m memsaver env``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from collections.abc import Iterator, Mapping
from typing import Any

from ._core import BUNDLED_LIBRARY, HOOK_MODE_ENV, ld_preload_entries
from ._memsaver import MemsaverError

#: Variables memsaver passes through to children when they are set in this process.
PASSTHROUGH_ENV = ("MEMSAVER_CUDA_LIB", "MEMSAVER_LOG")


def preload_path() -> str:
    """Absolute path of the libmemsaver.so bundled in this package (the one to preload).
    Raises ``MemsaverError`` when the installation has none, rather than hand out a path that
    the dynamic loader would skip with a one-line warning."""
    if not os.path.isfile(BUNDLED_LIBRARY):
        raise MemsaverError(
            f"{BUNDLED_LIBRARY} is missing: this memsaver installation has no libmemsaver.so. "
            "Reinstall it from a wheel (pip install --force-reinstall memsaver), or build one from "
            "a checkout with `pip install ./python` or `make python`."
        )
    return BUNDLED_LIBRARY


def merged_ld_preload(current: str, path: str) -> str:
    """``path`` first, then the entries of ``current`` (split on ':' or spaces, as ld.so does),
    each once."""
    entries = [path]
    for entry in ld_preload_entries(current):
        if entry not in entries:
            entries.append(entry)
    return ":".join(entries)


def subprocess_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a child process needs to run memsaver in preload mode.

    ``LD_PRELOAD`` (this package's libmemsaver.so first, then what ``environ`` already
    preloads), ``MEMSAVER_HOOK_MODE=preload`` (so that a child that lost the preload says so
    instead of silently running unhooked), and the ``MEMSAVER_*`` settings of ``environ`` that
    children must share. ``environ`` defaults to ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    env = {
        "LD_PRELOAD": merged_ld_preload(environ.get("LD_PRELOAD", ""), preload_path()),
        HOOK_MODE_ENV: "preload",
    }
    for name in PASSTHROUGH_ENV:
        if environ.get(name):
            env[name] = environ[name]
    return env


def ray_runtime_env(
    group: int,
    control: bool = True,
    env_vars: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Ray ``runtime_env`` whose workers run memsaver in preload mode, in ``group``, serving
    control requests (``control=False``: not)::

        Rollout.options(runtime_env=memsaver.ray_runtime_env(group=200)).remote()
        memsaver.control.group(200).pause("kv_cache")        # from the driver

    ``env_vars``: the variables of :func:`subprocess_env` (``LD_PRELOAD``,
    ``MEMSAVER_HOOK_MODE=preload``), every other ``MEMSAVER_*`` variable set in ``environ``
    (default ``os.environ``: the runtime directory, log filter, driver, timeouts, ... must be
    the same in the workers), ``MEMSAVER_GROUP`` and ``MEMSAVER_CONTROL``, then ``env_vars``.
    The paths must be valid on every node."""
    if isinstance(group, bool) or not isinstance(group, int):
        raise TypeError(f"memsaver.ray_runtime_env(group=...) takes an int, got {group!r}")
    environ = os.environ if environ is None else environ
    env = subprocess_env(environ)
    for name, value in environ.items():
        if name.startswith("MEMSAVER_") and value.strip():
            env.setdefault(name, value)
    env["MEMSAVER_GROUP"] = str(group)
    env["MEMSAVER_CONTROL"] = "1" if control else "0"
    env.update(env_vars or {})
    return {"env_vars": env}


@contextlib.contextmanager
def configure_subprocess() -> Iterator[dict[str, str]]:
    """Sets the variables of :func:`subprocess_env` in ``os.environ`` for the duration of the
    block, so that processes started inside it are preloaded; restores the previous values
    (or their absence) on exit. Yields the variables it set.
    """
    env = subprocess_env()
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def env_script(environ: Mapping[str, str] | None = None) -> str:
    """Shell lines (``eval``-able) that set up preload mode, with launcher examples."""
    env = subprocess_env(environ)
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    inline = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    ray_vars = json.dumps(env)
    return f"""\
# memsaver: environment for processes that use memsaver in preload mode.
# In a shell:  eval "$(python -m memsaver env)"
{exports}
#
# torchrun: the workers inherit torchrun's environment:
#   {inline} torchrun --nproc-per-node=8 train.py
#
# Ray: workers start from the raylet, not from this shell; pass the variables explicitly
# (the paths must be valid on every node):
#   ray.init(runtime_env={{"env_vars": {ray_vars}}})
# or, from Python:  runtime_env={{"env_vars": memsaver.subprocess_env()}}
#
# subprocess from Python:  with memsaver.configure_subprocess(): subprocess.run([...])
"""
