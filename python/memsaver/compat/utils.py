"""torch_memory_saver's ``utils``: the helpers its users and tests import."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .._launch import preload_path

__all__ = ["change_env", "get_binary_path_from_package", "is_xpu"]


def is_xpu() -> bool:
    """memsaver runs on CUDA only; Intel XPU is never used."""
    return False


def get_binary_path_from_package(stem: str) -> Path:
    """The library to preload. torch_memory_saver ships one per hook mode and CUDA major;
    memsaver has one library for every mode, so every ``stem`` names it."""
    del stem
    return Path(preload_path())


@contextlib.contextmanager
def change_env(key: str, value: str) -> Iterator[None]:
    """Sets ``os.environ[key]`` for the block, then restores the old value or its absence."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
