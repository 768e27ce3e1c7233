"""A pytest plugin (``-p load_vllm_plugins``) for running vLLM's own tests with memsaver's
vLLM plugin: it loads vLLM's general plugins as each vLLM process does, so memsaver's
registers its sleep-mode backend and, with ``MEMSAVER_VLLM=1``, installs its allocator, and
checks that it did."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    import memsaver.vllm
    from vllm.device_allocator.cumem import CuMemAllocator
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if "memsaver" not in SleepModeBackendFactory._registry:
        raise pytest.UsageError("memsaver's vLLM plugin did not register its backend")
    installed = isinstance(CuMemAllocator.instance, memsaver.vllm.Allocator)
    if installed != (os.environ.get("MEMSAVER_VLLM") == "1"):
        raise pytest.UsageError(f"memsaver's allocator installed: {installed}, MEMSAVER_VLLM: "
                                f"{os.environ.get('MEMSAVER_VLLM')!r}")
