#!/usr/bin/env bash
# The standard install, as a user does it: a clean clone of HEAD, a new virtual environment,
# `pip install ./python`, then the installed command and package on the fake driver that the
# wheel ships. Checks that the project's own files build everything the wheel needs.
set -euo pipefail
# A user's build: nothing handed over from this checkout's own build (see python/build.rs).
unset MEMSAVER_BUNDLE_FROM
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$root" "$work/src"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q ./"$(realpath --relative-to=. "$work/src/python")" 2>&1 | tail -20
bin="$work/venv/bin"
"$bin/memsaver" --version
lib=$("$bin/memsaver" preload-path)
test -f "$lib" || { echo "FAIL: $lib is missing"; exit 1; }
fake=$(dirname "$lib")/_fake/libcuda.so.1
test -f "$fake" || { echo "FAIL: the wheel carries no fake driver at $fake"; exit 1; }
export FAKE_CUDA_DIR="$work/state"
mkdir -p "$FAKE_CUDA_DIR"
(cd "$work" && env -u MEMSAVER_CUDA_LIB -u MEMSAVER_FAKE_CUDA_LIB "$bin/memsaver" demo --fake) | tail -2
(cd "$work" && MEMSAVER_CUDA_LIB="$fake" "$bin/python" - <<'PY'
import ctypes
import memsaver

with memsaver.region("weights", backup="cpu"):
    pass
p = memsaver._memsaver.malloc(4 << 20, 0, "weights", "cpu")
ctypes.memset(p, 7, 4 << 20)
memsaver.pause("weights")
memsaver.resume("weights")
assert ctypes.string_at(p, 4 << 20) == b"\x07" * (4 << 20)
print("installed package:", memsaver.__version__, memsaver.hook_mode(), "pause/resume ok")
PY
)
echo "PASS install"
