# Sourced at the start of a command on a lent GPU machine (no network, no Rust toolchain):
# installs the wheels built here by `make gpu-dist` (.dist) and any extra wheels in .whl into
# /tmp/site and puts it on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .dist/memsaver-*.whl $(ls .whl/*.whl 2>/dev/null) || return 1
export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0
