"""The package where its compiled extension (``memsaver._memsaver``) is missing, as in a Python
the wheel was not built for, or a source checkout on ``PYTHONPATH``: vLLM imports every installed
plugin (``memsaver.vllm:register``) in each of its processes, and with ``MEMSAVER_VLLM=1`` the
plugin must fail with the error that says what is missing, not leave vLLM's loader to log
Python's "partially initialized module ... (most likely due to a circular import)" and run without
memsaver. Each test runs a child whose import system hides the extension."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from helpers import run_python

# The child: the extension hidden, vLLM's sleep-mode backend factory faked (the plugin's entry
# point imports it), the plugin loaded as vLLM loads it (an entry point of the group
# vllm.general_plugins), then called.
_CHILD = r"""
import importlib.abc, importlib.metadata, json, sys, types

class NoExtension(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "memsaver._memsaver":
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, NoExtension())

class SleepModeBackendFactory:
    _registry = {}

    @classmethod
    def register_backend(cls, name, module, class_name):
        cls._registry[name] = (module, class_name)

for name in ("vllm", "vllm.device_allocator", "vllm.device_allocator.sleep_mode_backend"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["vllm.device_allocator.sleep_mode_backend"].SleepModeBackendFactory = SleepModeBackendFactory

out = {}
register = importlib.metadata.EntryPoint(
    name="memsaver", value="memsaver.vllm:register", group="vllm.general_plugins"
).load()
out["loaded"] = register.__module__
try:
    register()
    out["register"] = None
except ImportError as e:
    out["register"] = str(e)
out["registered"] = SleepModeBackendFactory._registry.get("memsaver")
import memsaver, memsaver.vllm
try:
    memsaver.vllm.MemsaverBackend
    out["backend"] = None
except ImportError as e:
    out["backend"] = str(e)
try:
    from memsaver import pause
    out["pause"] = None
except ImportError as e:
    out["pause"] = str(e)
out["version"] = memsaver.__version__
print(json.dumps(out))
"""


def _package_parent() -> str:
    """The directory the tests import memsaver from (the installed wheel, or a checkout's
    python/ on PYTHONPATH)."""
    spec = importlib.util.find_spec("memsaver")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(next(iter(spec.submodule_search_locations))).parent)


def _child(env: dict[str, str], **extra: str) -> dict[str, Any]:
    env = {**env, **extra}
    env["PYTHONPATH"] = os.pathsep.join([_package_parent(), *filter(None, [env.get("PYTHONPATH")])])
    r = run_python(_CHILD, env)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def _says_what_is_missing(message: str | None, asked_by: str, instead: str) -> None:
    assert message is not None
    assert "circular import" not in message, message
    assert f"memsaver.vllm: vLLM's sleep mode was asked to run on memsaver ({asked_by})" in message
    assert "compiled extension (memsaver._memsaver" in message, message
    assert "(hidden by the test)" in message, "the cause: " + message
    assert "pip install memsaver" in message and f"({instead} to run vLLM without it)" in message


def test_opted_in_without_the_extension_register_raises_what_is_missing(child_env):
    out = _child(child_env, MEMSAVER_VLLM="1")
    assert out["loaded"] == "memsaver.vllm", "the plugin imports without the extension"
    _says_what_is_missing(out["register"], "MEMSAVER_VLLM=1", "unset MEMSAVER_VLLM")
    assert out["registered"] == ["memsaver.vllm", "MemsaverBackend"]


def test_not_opted_in_without_the_extension_register_does_nothing_but_name_the_backend(child_env):
    child_env.pop("MEMSAVER_VLLM", None)
    for value in (None, "0"):
        out = _child(child_env, **({} if value is None else {"MEMSAVER_VLLM": value}))
        assert out["register"] is None, out["register"]
        assert out["registered"] == ["memsaver.vllm", "MemsaverBackend"]
        # The backend's name, chosen later, says what is missing when vLLM makes the backend.
        _says_what_is_missing(
            out["backend"], "--sleep-mode-backend memsaver", "choose another --sleep-mode-backend"
        )


def test_the_package_without_the_extension_imports_and_its_names_say_what_is_missing(child_env):
    out = _child(child_env)
    message = out["pause"]
    assert message is not None and "circular import" not in message, message
    assert message.startswith("memsaver.pause: memsaver's compiled extension (memsaver._memsaver")
    assert "pip install memsaver" in message and "(hidden by the test)" in message
    assert out["version"]
