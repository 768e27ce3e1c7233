# The commands README, CI and people run. `make demo` and `make test` are the two set-up
# commands: each builds what it needs first.

SHELL := /bin/bash
CARGO ?= cargo
FAKE_DIR := target/fake-cuda
FAKE_LIB := $(FAKE_DIR)/libcuda.so.1

.PHONY: all build fake-cuda python demo test test-rust test-python lint fmt options-doc gpu-dist clean

VENV := .venv
PY := $(VENV)/bin/python

all: lint test

build:
	$(CARGO) build --release --workspace

# The fake CUDA driver (host memory behind the driver API) for tests and GPU-less demos, and
# a libnccl.so.2 stand-in that reaches the driver the way NCCL does.
fake-cuda:
	$(CARGO) build --release -p fake-cuda -p fake-nccl
	mkdir -p $(FAKE_DIR) target/fake-nccl
	cp target/release/libcuda.so $(FAKE_LIB)
	cp target/release/libnccl.so target/fake-nccl/libnccl.so.2

# The Python package, built with maturin into a project-local virtual environment that also
# holds the test tools (everything comes from PyPI; nothing is assumed installed).
$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.5,<2" pytest

python: $(PY)
	$(CARGO) build --release -p memsaver-shim
	cp target/release/libmemsaver.so python/memsaver/libmemsaver.so
	rm -f target/wheels/memsaver-*.whl
	$(VENV)/bin/maturin build --release -q -m python/Cargo.toml -i $(PY) -o target/wheels
	$(PY) -m pip install -q --force-reinstall --no-deps target/wheels/memsaver-*.whl

# A staged pause/resume cycle: on the GPU when there is one, else on the fake driver. Then the
# verl GRPO profile (docs/examples) through the Python package, with its timeline page.
demo: build fake-cuda python
	target/release/memsaver demo
	@if nvidia-smi -L >/dev/null 2>&1; then lib=; else lib=$(CURDIR)/$(FAKE_LIB); fi; \
	MEMSAVER_CUDA_LIB=$$lib $(PY) -m memsaver demo docs/examples/verl_grpo.yaml -o target/demo

# Everything CI runs. Each run gets its own fake-driver state directory, so concurrent runs
# and other users of the fake driver do not see each other's memory.
test: fake-cuda test-rust test-python

# The NCCL-hook scenarios preload target/release/libmemsaver.so, which `cargo test` alone does
# not link: build it first.
test-rust: fake-cuda
	$(CARGO) build --release -p memsaver-shim
	@state=$$(mktemp -d /dev/shm/memsaver-test.XXXXXX 2>/dev/null || mktemp -d); \
	trap 'rm -rf "$$state"' EXIT; \
	MEMSAVER_CUDA_LIB=$(CURDIR)/$(FAKE_LIB) MEMSAVER_FAKE_CUDA_LIB=$(CURDIR)/$(FAKE_LIB) \
	FAKE_CUDA_DIR=$$state $(CARGO) test --release --workspace

test-python: fake-cuda python
	@state=$$(mktemp -d /dev/shm/memsaver-test.XXXXXX 2>/dev/null || mktemp -d); \
	trap 'rm -rf "$$state"' EXIT; \
	MEMSAVER_CUDA_LIB=$(CURDIR)/$(FAKE_LIB) FAKE_CUDA_DIR=$$state \
	$(PY) -m pytest tests/python -q

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

# docs/options.md, generated from the option table in allocator/src/options.rs (a test of the
# allocator fails when they differ).
options-doc:
	$(CARGO) run --release -q -p memsaver-shim --bin memsaver -- options --markdown > docs/options.md.tmp
	mv docs/options.md.tmp docs/options.md

# Binaries for a lent GPU machine (no Rust toolchain there): carry .dist in the device call.
gpu-dist: build fake-cuda python
	rm -rf .dist && mkdir -p .dist
	cp target/release/memsaver target/release/libmemsaver.so target/wheels/memsaver-*.whl .dist/
	cp -r tests/gpu .dist/

clean:
	$(CARGO) clean
	rm -rf .dist $(VENV) python/memsaver/libmemsaver.so
