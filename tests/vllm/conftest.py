"""Tests of memsaver's vLLM plugin (memsaver.vllm) against vLLM 0.33.0's own modules, on CPU
torch and the fake CUDA driver: run them with `make test-vllm`, which installs vLLM (without
its dependencies) into .venv-vllm."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

# As in tests/python: with MEMSAVER_REQUIRE_ALL_TESTS=1 (CI) a skipped test fails.
REQUIRE_ALL = "MEMSAVER_REQUIRE_ALL_TESTS"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if os.environ.get(REQUIRE_ALL) == "1" and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped, but {REQUIRE_ALL}=1 requires every test to run: {report.longrepr}"
    return report


def pytest_configure(config: pytest.Config) -> None:
    lib = os.environ.get("MEMSAVER_CUDA_LIB", "")
    try:
        is_fake = bool(lib) and hasattr(ctypes.CDLL(lib), "fakecuda_reset_faults")
    except OSError:
        is_fake = False
    if not is_fake:
        pytest.exit("the vLLM tests need the fake CUDA driver and vLLM: run them with `make test-vllm`",
                    returncode=2)


class Pluggable:
    """libmemsaver.so's entry points for torch's CUDAPluggableAllocator, called as torch calls
    them when a tensor is made in a memsaver pool (this CPU torch has no CUDA)."""

    def __init__(self) -> None:
        import memsaver

        memsaver.hook_mode()
        self.lib = ctypes.CDLL(memsaver.preload_path())
        self.lib.memsaver_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.memsaver_torch_malloc.restype = ctypes.c_void_p
        self.lib.memsaver_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

    def malloc(self, size: int) -> int:
        p = self.lib.memsaver_torch_malloc(size, 0, None)
        assert p, "memsaver_torch_malloc failed (outside a region?)"
        return int(p)

    def free(self, ptr: int) -> None:
        self.lib.memsaver_torch_free(ptr, 0, 0, None)


@pytest.fixture(scope="session")
def pluggable() -> Pluggable:
    return Pluggable()


@pytest.fixture
def fake() -> Iterator[ctypes.CDLL]:
    lib = ctypes.CDLL(os.environ["MEMSAVER_CUDA_LIB"])
    yield lib
    lib.fakecuda_reset_faults()


@pytest.fixture
def vllm_on_memsaver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """memsaver's allocator installed in vLLM (as MEMSAVER_VLLM=1 does), on a CUDA platform
    as far as vLLM's allocator lookup is concerned (the machine has no GPU), with a fresh
    allocator object; vLLM's own allocator is given back afterwards."""
    import memsaver.vllm as mv
    import vllm.device_allocator as alloc_pkg

    monkeypatch.setattr(alloc_pkg, "current_platform",
                        SimpleNamespace(is_cuda_alike=lambda: True, is_xpu=lambda: False, is_rocm=lambda: False))
    monkeypatch.setattr(mv, "_instance", None)
    mv.install()
    try:
        yield alloc_pkg.get_mem_allocator_instance()
    finally:
        mv.uninstall()


def run_child(code: str, **env: str) -> Any:
    """Runs ``code`` in a fresh interpreter of this environment (vLLM's plugin state is per
    process), with ``env`` added; returns the completed process."""
    import subprocess

    full = dict(os.environ)
    full.pop("MEMSAVER_VLLM", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)
