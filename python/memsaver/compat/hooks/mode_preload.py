"""torch_memory_saver's ``hooks.mode_preload``: preload mode for child processes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ..._core import HOOK_MODE_ENV
from ..._launch import merged_ld_preload
from ..utils import change_env, get_binary_path_from_package

__all__ = ["configure_subprocess", "get_binary_path_from_package"]

_STEM = "torch_memory_saver_hook_mode_preload"


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """Processes started inside the block run in preload mode: ``LD_PRELOAD`` names memsaver's
    library first, followed by what was preloaded already; both variables are restored on exit.

    Children also get ``MEMSAVER_HOOK_MODE=preload``, so one that lost the preload on the way
    (a launcher that rewrites ``LD_PRELOAD``) says so instead of running unhooked.
    """
    # Looked up at call time, so that tests can substitute the path.
    path = str(get_binary_path_from_package(_STEM))
    preload = merged_ld_preload(os.environ.get("LD_PRELOAD", ""), path)
    with change_env("LD_PRELOAD", preload), change_env(HOOK_MODE_ENV, "preload"):
        yield
