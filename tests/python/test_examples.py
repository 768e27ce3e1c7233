"""The integration examples (docs/examples/integrations) run on the fake driver."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

DIR = pathlib.Path(__file__).parents[2] / "docs" / "examples" / "integrations"
EXAMPLES = sorted(p for p in DIR.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, tmp_path):
    env = dict(os.environ, FAKE_CUDA_DIR=str(tmp_path))
    env.pop("LD_PRELOAD", None)
    r = subprocess.run(
        [sys.executable, path.name], cwd=DIR, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "example: ok" in r.stdout


def test_every_integration_has_an_example():
    names = {p.stem for p in EXAMPLES}
    assert names >= {"verl_multistage_wake", "sglang_compat", "vllm_sleep_levels", "launchers"}
