"""torchrun and Ray: pass the preload and the group id to every worker.

The preload must be in place when a worker process starts (before torch and NCCL load), and
every process of one job must share a group id (``MEMSAVER_GROUP``) distinct from co-located
jobs on the same GPUs (training vs inference):

    # torchrun: export in the launching shell; torchrun passes the environment on
    eval "$(python -m memsaver env)"
    MEMSAVER_GROUP=100 torchrun --nproc-per-node 8 train.py

    # Ray: the same variables through runtime_env
    ray.init(runtime_env={"env_vars": {**memsaver.subprocess_env(), "MEMSAVER_GROUP": "200"}})

``memsaver.configure_subprocess()`` does the same for ``subprocess``/``multiprocessing`` children.
"""

from __future__ import annotations

import json
import subprocess
import sys

import memsaver


def main() -> None:
    env = memsaver.subprocess_env()
    runtime_env = {"env_vars": {**env, "MEMSAVER_GROUP": "200"}}
    print("Ray runtime_env:", json.dumps(runtime_env, indent=1))
    assert memsaver.preload_path() in env["LD_PRELOAD"]
    # A worker started with those variables runs in preload mode (as a torchrun rank would).
    with memsaver.configure_subprocess():
        out = subprocess.run(
            [sys.executable, "-c", "import memsaver; print(memsaver.hook_mode())"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    print("worker hook mode:", out)
    assert out == "preload"
    print("launchers example: ok")


if __name__ == "__main__":
    main()
