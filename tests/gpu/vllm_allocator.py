#!/usr/bin/env python3
"""vLLM 0.33.0's allocator-level tests on one GPU, with memsaver in place of vLLM's allocator.

Runs ``test_python_error``, ``test_basic_cumem`` and ``test_cumem_with_cudagraph`` of vLLM's
``tests/basic_correctness/memory/cumem/test_cumem.py`` (v0.33.0), unchanged, each in a process of
its own (what vLLM's ``create_new_process_for_each_test`` does), with memsaver's vLLM plugin
opted in (``MEMSAVER_VLLM=1``): ``get_mem_allocator_instance()`` is memsaver's allocator.
Exits 0 only if all three pass.

The GPU machine has torch but not vLLM, and no network: ``make gpu-vllm`` puts what this needs
under ``.dist/vllm`` (carry ``.dist``): vLLM's Python files taken from its wheel (no compiled
extension), vLLM's test files at the tag, and the few pure-Python packages vLLM's modules import
that such a machine lacks. Usage, on the GPU machine::

    pip install .dist/memsaver-*.whl        # or have it installed
    python .dist/gpu/vllm_allocator.py      # finds .dist/vllm next to it, or --carry DIR

Three stand-ins of ours, for imports the three tests do not use (each raises if it is used):
``vllm._C_stable_libtorch`` (vLLM's compiled kernels, 92 MB, built for torch 2.14, which the CUDA
platform module imports), ``vllm.LLM``/``vllm.SamplingParams`` (the engine, imported at the top of
the test file for its other tests) and ``tests.utils.create_new_process_for_each_test`` (vLLM's
test utilities import the whole engine and its servers; this script runs each test in a process
of its own instead). Each is used only when the real module cannot be imported, and the script
says which ones it used.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

TESTS = ("test_python_error", "test_basic_cumem", "test_cumem_with_cudagraph")
TEST_FILE = "tests/basic_correctness/memory/cumem/test_cumem.py"
HERE = Path(__file__).resolve().parent
STAND_INS: list[str] = []


def _unusable(name: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} is a stand-in of tests/gpu/vllm_allocator.py: this test needs the real one")

    return fail


def _stand_in(module: str, **attrs: Any) -> None:
    m = types.ModuleType(module)
    m.__dict__.update(attrs)
    sys.modules[module] = m
    STAND_INS.append(module)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception as e:  # noqa: BLE001 - any failure means the stand-in is needed
        print(f"vllm_allocator: {module} cannot be imported here ({type(e).__name__}: {e}); "
              "using a stand-in", file=sys.stderr)
        return False


# -- the pytest plugin (-p vllm_allocator), in each test's process ----------------------------


def pytest_configure(config: Any) -> None:
    if not _importable("vllm._C_stable_libtorch"):
        _stand_in("vllm._C_stable_libtorch")
    if not _importable("vllm.entrypoints.llm"):
        _stand_in("vllm.entrypoints.llm", LLM=_unusable("vllm.LLM"))
    if not _importable("vllm.sampling_params"):
        _stand_in("vllm.sampling_params", SamplingParams=_unusable("vllm.SamplingParams"))
    if not _importable("tests.utils"):
        _stand_in("tests.utils", create_new_process_for_each_test=lambda *a, **k: (lambda f: f))
    # As each vLLM process does: load the general plugins (memsaver's is opted in).
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import memsaver.vllm
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.device_allocator.cumem import CuMemAllocator

    if os.environ.get("VLLM_ALLOCATOR_COLLECT_ONLY") == "1":
        allocator = CuMemAllocator.instance  # no GPU: vLLM has no CUDA platform to ask
    else:
        allocator = get_mem_allocator_instance()
    if not isinstance(allocator, memsaver.vllm.Allocator):
        raise RuntimeError(f"vLLM's allocator is {type(allocator)}, not memsaver's: is memsaver installed "
                           "in this Python environment (its entry point), and MEMSAVER_VLLM=1?")
    print(f"vllm_allocator: vLLM allocates through {type(allocator).__module__}.{type(allocator).__name__}"
          f" ({memsaver.hook_mode()} mode); stand-ins: {', '.join(STAND_INS) or 'none'}", file=sys.stderr)


# -- the runner ------------------------------------------------------------------------------


def _unpack(carry: Path, into: Path) -> None:
    """vLLM's Python files, its tests and the extra packages, under ``into``."""
    with tarfile.open(carry / "vllm-py.tar.gz") as t:
        t.extractall(into / "site", filter="data")
    for wheel in sorted((carry / "wheels").glob("*.whl")):
        module = wheel.name.split("-")[0].lower()
        if importlib.util.find_spec(module) is not None:
            continue  # the machine has it: keep its own
        print(f"vllm_allocator: {module} is missing here; using the carried {wheel.name}", file=sys.stderr)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(into / "site")
    with tarfile.open(carry / "vllm-tests.tar.gz") as t:
        t.extractall(into / "src", filter="data")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--carry", type=Path, default=HERE.parent / "vllm",
                    help="the folder `make gpu-vllm` made (default: .dist/vllm next to this script)")
    ap.add_argument("--collect-only", action="store_true",
                    help="only import and collect the tests (checks the carry on a machine without a GPU)")
    ap.add_argument("tests", nargs="*", default=list(TESTS), help=f"default: {' '.join(TESTS)}")
    args = ap.parse_args()
    import memsaver  # noqa: F401 - fail early, clearly, without it

    failed = []
    with tempfile.TemporaryDirectory(prefix="memsaver-vllm-") as tmp:
        root = Path(tmp)
        _unpack(args.carry, root)
        env = dict(os.environ)
        env["MEMSAVER_VLLM"] = "1"
        env["VLLM_PLUGINS"] = "memsaver"  # vLLM's own plugins need the engine's packages
        env["PYTHONPATH"] = os.pathsep.join(
            [str(root / "site"), str(HERE), str(root / "src"), env.get("PYTHONPATH", "")])
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        for name in args.tests:
            cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                   "-p", "vllm_allocator", f"{TEST_FILE}::{name}"]
            if args.collect_only:
                cmd.append("--collect-only")
                env["VLLM_ALLOCATOR_COLLECT_ONLY"] = "1"
            print(f"== {name}", flush=True)
            r = subprocess.run(cmd, cwd=root / "src", env=env, timeout=600)
            if r.returncode != 0:
                failed.append(name)
    if failed:
        print(f"vllm_allocator: failed: {', '.join(failed)}")
    if args.collect_only:
        print(f"{len(args.tests) - len(failed)} collected, {len(failed)} failed to collect (nothing ran)")
        return 1 if failed else 0
    print(f"{len(args.tests) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
