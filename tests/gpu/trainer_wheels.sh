#!/usr/bin/env bash
# Fetches what megatron_trainer.py and deepspeed_trainer.py need beyond the GPU machine's image
# (torch, transformers, numpy, ninja, einops, msgpack, psutil, py-cpuinfo, tqdm are there) into
# .whl/, about 7 MiB, for a machine with no network (tests/gpu/README.md). Run here, with network.
#   megatron-core 0.19.2: a wheel for CPython 3.12 (the GPU image's Python);
#   deepspeed 0.19.8: a source package, built here into a pure-Python wheel with no op
#     pre-built (DS_BUILD_OPS=0: its FusedAdam is built just in time on the GPU machine);
#   pydantic, pydantic-core, annotated-types, typing-inspection, hjson: deepspeed's missing needs.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
fetch() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$@"
}
fetch megatron-core==0.19.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 hjson==3.1.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary=:all: -d "$work" deepspeed==0.19.8
tar xzf "$work"/deepspeed-0.19.8.tar.gz -C "$work"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q setuptools wheel
(cd "$work/deepspeed-0.19.8" && DS_BUILD_OPS=0 "$work/venv/bin/pip" wheel -q --no-deps \
    --no-build-isolation -w "$OLDPWD/.whl" .)
ls -l .whl
