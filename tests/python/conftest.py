"""Shared fixtures of the Python tests. They run on the fake CUDA driver (device memory is host
memory at the same address, so tests read and write allocations with ctypes): run them with
`make test-python`, which points MEMSAVER_CUDA_LIB at target/fake-cuda/libcuda.so.1.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from helpers import Hooks

# Every test must run: a skip is a failure. CI sets it (.ci/run): it runs as root, with
# Chromium and a compiler, so a missing precondition there is a broken machine. The Rust tests
# read the same variable (tests/support).
REQUIRE_ALL = "MEMSAVER_REQUIRE_ALL_TESTS"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if os.environ.get(REQUIRE_ALL) == "1" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but {REQUIRE_ALL}=1 requires every test to run: {reason}"
    return report


def pytest_configure(config: pytest.Config) -> None:
    lib = os.environ.get("MEMSAVER_CUDA_LIB", "")
    try:
        is_fake = bool(lib) and hasattr(ctypes.CDLL(lib), "fakecuda_reset_faults")
    except OSError:
        is_fake = False
    if not is_fake:
        pytest.exit(
            "the Python tests need the fake CUDA driver: run them with `make test-python` "
            f"(MEMSAVER_CUDA_LIB={lib!r} is not target/fake-cuda/libcuda.so.1)",
            returncode=2,
        )


@pytest.fixture(scope="session")
def hooks() -> Hooks:
    return Hooks()


_counter = itertools.count()


@pytest.fixture
def tag(request: pytest.FixtureRequest) -> str:
    """A tag name unique to the test (tags live as long as the process)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", request.node.name)[:40]
    return f"{name}_{next(_counter)}"


@pytest.fixture
def tag2(tag: str) -> str:
    return f"{tag}_b"


@pytest.fixture
def child_env(tmp_path) -> Iterator[dict[str, str]]:
    """Environment of an isolated child: its own fake-driver state, no preload, no mode."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    state = tempfile.mkdtemp(prefix="memsaver-pytest.", dir=shm)
    env = dict(os.environ)
    env["FAKE_CUDA_DIR"] = state
    for name in (
        "LD_PRELOAD",
        "MEMSAVER_HOOK_MODE",
        "FAKE_CUDA_FAIL_CREATE_AT",
        "FAKE_CUDA_FAIL_MAP_AT",
    ):
        env.pop(name, None)
    yield env
    shutil.rmtree(state, ignore_errors=True)
