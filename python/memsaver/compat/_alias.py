"""``import torch_memory_saver`` served by ``memsaver.compat``, opt-in.

Installed at interpreter start by the ``memsaver_torch_memory_saver.pth`` file of the wheel when
``MEMSAVER_TORCH_MEMORY_SAVER=1`` is set (so subprocesses, spawned multiprocessing workers and
Ray workers that inherit the variable get it too), or by calling :func:`install_alias`.
A finder at the front of ``sys.meta_path`` maps ``torch_memory_saver[.sub]`` to
``memsaver.compat[.sub]``: both names then refer to the same module objects, so patching one
patches the other.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

ALIAS_ENV = "MEMSAVER_TORCH_MEMORY_SAVER"
_NAME = "torch_memory_saver"
_TARGET = "memsaver.compat"


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed under its own name


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _NAME and not fullname.startswith(_NAME + "."):
            return None
        real = _TARGET + fullname[len(_NAME) :]
        real_spec = importlib.util.find_spec(real)
        if real_spec is None:
            return None
        return importlib.util.spec_from_loader(
            fullname, _Loader(real), is_package=real_spec.submodule_search_locations is not None
        )


def _shadowed() -> str | None:
    """Where a real torch_memory_saver is installed, if one is."""
    for finder in sys.meta_path:
        if isinstance(finder, _Finder):
            continue
        find = getattr(finder, "find_spec", None)
        spec = find(_NAME, None) if find else None
        if spec is not None:
            return spec.origin or str(spec.submodule_search_locations)
    return None


def install_alias() -> None:
    """Makes ``import torch_memory_saver`` (and its submodules) give ``memsaver.compat`` in
    this process. Says so on stderr when it shadows an installed torch_memory_saver."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if _NAME in sys.modules and not sys.modules[_NAME].__name__.startswith(_TARGET):
        raise ImportError(
            f"{_NAME} was imported before memsaver's alias was installed; call "
            "memsaver.compat.install_alias() (or set MEMSAVER_TORCH_MEMORY_SAVER=1) first"
        )
    shadowed = _shadowed()
    if shadowed is not None:
        sys.stderr.write(
            f"memsaver: {ALIAS_ENV}=1: 'import {_NAME}' gives memsaver.compat; the installed "
            f"{_NAME} at {shadowed} is not used (unset {ALIAS_ENV} to use it)\n"
        )
    sys.meta_path.insert(0, _Finder())


def _from_env() -> None:
    """Called by the .pth file at interpreter start: strict like every memsaver option
    (docs/options.md), but an invalid value cannot raise here, so it warns and stays off."""
    value = os.environ.get(ALIAS_ENV, "").strip()
    if value.lower() in ("", "0", "false"):
        return
    if value.lower() not in ("1", "true"):
        sys.stderr.write(
            f"memsaver: {ALIAS_ENV}='{value}': expected 0 or 1; the torch_memory_saver alias is off\n"
        )
        return
    try:
        install_alias()
    except Exception as e:  # never break interpreter start-up
        sys.stderr.write(f"memsaver: {ALIAS_ENV} is set but the alias failed: {e}\n")
