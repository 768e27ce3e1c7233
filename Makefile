# The commands README, CI and people run. `make demo` and `make test` are the two set-up
# commands: each builds what it needs first.

SHELL := /bin/bash
CARGO ?= cargo
# python/build.rs copies libmemsaver.so and the fake driver into the Python package from here
# instead of building them a second time (it does for a plain `pip install ./python`).
export MEMSAVER_BUNDLE_FROM := $(CURDIR)/target/release
FAKE_DIR := target/fake-cuda
FAKE_LIB := $(FAKE_DIR)/libcuda.so.1

.PHONY: all build fake-cuda python demo test test-rust test-python test-ray test-vllm test-install lint lint-rust lint-python fmt abi options-doc gpu-dist gpu-vllm clean

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

python: $(PY) fake-cuda
	$(CARGO) build --release -p memsaver-shim
	rm -f target/wheels/memsaver-*.whl
	$(VENV)/bin/maturin build --release -q -m python/Cargo.toml -i $(PY) -o target/wheels
	$(PY) -c "import glob, sys, zipfile; \
		names = set(zipfile.ZipFile(glob.glob('target/wheels/memsaver-*.whl')[0]).namelist()); \
		sys.exit(0 if {'memsaver/libmemsaver.so', 'memsaver/_fake/libcuda.so.1'} <= names \
		else 'the wheel lacks libmemsaver.so or the fake driver')"
	$(PY) -m pip install -q --force-reinstall --no-deps target/wheels/memsaver-*.whl

# A staged pause/resume cycle: on the GPU when there is one, else on the fake driver. Then the
# verl GRPO profile (docs/examples) through the Python package, with its timeline page.
# Both through the `memsaver` command the wheel installs.
demo: build fake-cuda python
	@if nvidia-smi -L >/dev/null 2>&1; then lib=; else lib=$(CURDIR)/$(FAKE_LIB); fi; \
	set -x; \
	MEMSAVER_CUDA_LIB=$$lib $(VENV)/bin/memsaver demo && \
	MEMSAVER_CUDA_LIB=$$lib $(VENV)/bin/memsaver demo docs/examples/verl_grpo.yaml -o target/demo

# The tests CI runs (CI also runs `make lint` and `make test-install`: .ci/run). Each run gets its own fake-driver state directory, so concurrent runs
# and other users of the fake driver do not see each other's memory. A test that cannot run on
# this machine (not root, no compiler, no Chromium) says so (Rust: a "SKIPPED <test>: <why>"
# line; pytest: its skip summary); MEMSAVER_REQUIRE_ALL_TESTS=1, set by CI, makes each such
# skip a failure.
test: fake-cuda test-rust test-python test-ray test-vllm

# Every suite has a time limit of its own, so that a hung test fails `make test` instead of
# hanging it, and the log names the test: libtest reports a test running for over 60 s, and
# pytest (faulthandler_timeout) dumps the stacks of a test running for over 300 s.
# `$(call within,SECONDS,SUITE,COMMAND)` runs COMMAND under that limit and says which suite ran
# out of time.
within = timeout $(1) $(3) || { rc=$$?; [ $$rc -ne 124 ] || echo "$(2): over $(1) s: a test hangs (named above: running for over 60 s, or the stacks dumped)" >&2; exit $$rc; }
PYTEST_HANG := -o faulthandler_timeout=300

# The NCCL-hook scenarios preload target/release/libmemsaver.so, which `cargo test` alone does
# not link: build it first.
test-rust: fake-cuda
	$(CARGO) build --release -p memsaver-shim
	@state=$$(mktemp -d /dev/shm/memsaver-test.XXXXXX 2>/dev/null || mktemp -d); \
	trap 'rm -rf "$$state"' EXIT; \
	MEMSAVER_CUDA_LIB=$(CURDIR)/$(FAKE_LIB) MEMSAVER_FAKE_CUDA_LIB=$(CURDIR)/$(FAKE_LIB) \
	FAKE_CUDA_DIR=$$state MEMSAVER_RUNTIME_DIR=$$state/rt \
	$(call within,2400,test-rust,$(CARGO) test --release --workspace)

test-python: fake-cuda python
	@state=$$(mktemp -d /dev/shm/memsaver-test.XXXXXX 2>/dev/null || mktemp -d); \
	trap 'rm -rf "$$state"' EXIT; \
	MEMSAVER_CUDA_LIB=$(CURDIR)/$(FAKE_LIB) FAKE_CUDA_DIR=$$state \
	MEMSAVER_RUNTIME_DIR=$$state/rt \
	MEMSAVER_FAKE_NCCL_LIB=$(CURDIR)/target/fake-nccl/libnccl.so.2 \
	$(call within,1200,test-python,$(PY) -m pytest tests/python -q -rfEs $(PYTEST_HANG))

# Ray actors driven through memsaver.control on a local Ray cluster (CPU, fake driver). Ray is
# a large download, installed into .venv for this test only; an install that fails (no PyPI)
# fails the target: the test is never skipped for want of ray.
RAY := $(VENV)/.ray
$(RAY): | $(PY)
	$(PY) -m pip install -q "ray>=2.9"
	touch $@

test-ray: fake-cuda python $(RAY)
	@state=$$(mktemp -d /dev/shm/memsaver-test.XXXXXX 2>/dev/null || mktemp -d); \
	trap 'rm -rf "$$state"' EXIT; \
	MEMSAVER_CUDA_LIB=$(CURDIR)/$(FAKE_LIB) FAKE_CUDA_DIR=$$state RAY_USAGE_STATS_ENABLED=0 \
	MEMSAVER_RUNTIME_DIR=$$state/rt timeout 300 $(PY) -m pytest tests/ray -q -p no:cacheprovider $(PYTEST_HANG)

# vLLM 0.33.0's sleep mode on memsaver's plugin (memsaver.vllm), on CPU and the fake driver.
# vLLM is installed without its dependencies into a virtual environment of its own
# ($(VLLM_VENV)), with only what its allocator and sleep-mode modules import: torch (PyPI's
# wheel, with its CUDA libraries: about 5.4 GB, 75 s here; CPU-only wheels are not on PyPI),
# numpy, packaging, psutil and regex. vLLM's sources at the tag come from its sdist (the
# build tools listed let pip read its metadata), unpacked into $(VLLM_SRC), never into the
# repository: its CPU test of sleep-mode backends runs with the plugin loaded, and `make
# gpu-vllm` takes its allocator tests from there. An install or download that fails fails the
# target: nothing is skipped for want of vLLM.
VLLM_VERSION := 0.33.0
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.vllm-$(VLLM_VERSION)
VLLM_SRC := target/vllm-$(VLLM_VERSION)
VLLM_DEPS := pytest "torch==2.14.0" numpy packaging psutil regex
VLLM_BUILD_TOOLS := setuptools wheel "setuptools-scm>=8" setuptools-rust
# vLLM's tests that the CPU run takes (with the __init__.py files of their packages).
VLLM_TESTS := tests/__init__.py tests/v1/__init__.py tests/v1/worker/__init__.py \
	tests/v1/worker/test_sleep_mode_backend.py tests/basic_correctness/__init__.py \
	tests/basic_correctness/memory/__init__.py tests/basic_correctness/memory/cumem/__init__.py \
	tests/basic_correctness/memory/cumem/test_cumem.py

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_DEPS) $(VLLM_BUILD_TOOLS)
	$(VLLM_PY) -m pip install -q --no-deps "vllm==$(VLLM_VERSION)"
	touch $@

$(VLLM_SRC)/.stamp: $(VLLM_STAMP)
	rm -rf $(VLLM_SRC) && mkdir -p $(VLLM_SRC)
	VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 $(VLLM_PY) -m pip download -q \
		--no-deps --no-binary :all: --no-build-isolation "vllm==$(VLLM_VERSION)" -d $(VLLM_SRC)
	tar -xzf $(VLLM_SRC)/vllm-$(VLLM_VERSION).tar.gz -C $(VLLM_SRC) --strip-components=1 \
		$(addprefix vllm-$(VLLM_VERSION)/,$(VLLM_TESTS))
	rm $(VLLM_SRC)/vllm-$(VLLM_VERSION).tar.gz
	touch $@

# Our tests of the plugin against vLLM's modules (tests/vllm), then vLLM's own CPU test of
# sleep-mode backends with the plugin loaded and opted in. Its worker test
# (test_worker_drives_communicator_suspension) builds vLLM's GPU worker, which imports the
# whole engine (transformers, pydantic, ...), none of which the plugin touches: deselected.
# The fake driver is on LD_LIBRARY_PATH because vLLM's cumem module loads its extension,
# which links libcuda.so.1. VLLM_PLUGINS=memsaver: vLLM's own LoRA resolver plugins import
# modules of the engine (msgspec, ...) that this environment leaves out.
test-vllm: fake-cuda python $(VLLM_STAMP) $(VLLM_SRC)/.stamp
	$(VLLM_PY) -m pip install -q --force-reinstall --no-deps target/wheels/memsaver-*.whl
	@state=$$(mktemp -d /dev/shm/memsaver-test.XXXXXX 2>/dev/null || mktemp -d); \
	trap 'rm -rf "$$state"' EXIT; \
	export MEMSAVER_CUDA_LIB=$(CURDIR)/$(FAKE_LIB) FAKE_CUDA_DIR=$$state \
		LD_LIBRARY_PATH=$(CURDIR)/$(FAKE_DIR) VLLM_PLUGINS=memsaver; \
	timeout 900 $(VLLM_PY) -m pytest tests/vllm -q -rfEs -p no:cacheprovider $(PYTEST_HANG) && \
	cd $(VLLM_SRC) && MEMSAVER_VLLM=1 PYTHONPATH=$(CURDIR)/tests/vllm timeout 900 \
		$(CURDIR)/$(VLLM_PY) -m pytest $(PYTEST_HANG) \
		-q -rfEs -p no:cacheprovider -p load_vllm_plugins tests/v1/worker/test_sleep_mode_backend.py \
		--deselect tests/v1/worker/test_sleep_mode_backend.py::test_worker_drives_communicator_suspension

# The standard install from a clean clone of HEAD into a new virtual environment
# (`pip install ./python`), then the installed command and package on the bundled fake driver.
test-install:
	tests/install.sh

lint: lint-rust lint-python

lint-rust:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	# The code's own docs, private items included (read with --document-private-items): every
	# link names an item that exists. Links from public docs to private items are fine there.
	RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" \
		$(CARGO) doc --no-deps --workspace --document-private-items

# Python: ruff (ruff.toml), mypy --strict on the package, and stubtest of the package's types (its
# annotated sources, and the hand-written _memsaver.pyi of the compiled extension) against the
# installed wheel (run outside the source tree, which has no extension).
LINT_TOOLS := $(VENV)/.lint-tools
$(LINT_TOOLS): | $(PY)
	$(PY) -m pip install -q "ruff==0.17.6" "mypy==2.4.1"
	touch $@

lint-python: $(LINT_TOOLS) python
	$(VENV)/bin/ruff check python/memsaver tests/python tests/ray tests/vllm tests/gpu bench
	$(VENV)/bin/mypy --config-file python/pyproject.toml python/memsaver
	cd /tmp && $(CURDIR)/$(PY) -m mypy.stubtest memsaver \
		--mypy-config-file $(CURDIR)/python/pyproject.toml \
		--allowlist $(CURDIR)/python/stubtest-allowlist.txt

fmt:
	$(CARGO) fmt --all

# The C ABI is defined in torch-shim/src (crate doc, exported functions, status.rs). This
# regenerates the files made from it, torch-shim/include/memsaver.h (cbindgen) and
# python/src/abi.rs; `make test` fails while a checked-in copy differs.
abi:
	WRITE_ABI_FILES=1 $(CARGO) test --release -p memsaver-shim --test abi_files

# docs/options.md, generated from the option lists of every layer (allocator/src/options.rs,
# ipc/src/options.rs, nccl-hook/src/options.rs, torch-shim/src/options.rs: the registry; a test
# of torch-shim fails when they differ).
options-doc:
	WRITE_OPTIONS_DOC=1 $(CARGO) test --release -q -p memsaver-shim --lib \
		options::tests::docs_options_md_is_generated_from_the_table

# Binaries for a lent GPU machine (no Rust toolchain there): carry .dist in the device call.
gpu-dist: build fake-cuda python
	rm -rf .dist && mkdir -p .dist
	cp target/release/libmemsaver.so target/wheels/memsaver-*.whl .dist/
	cp -r tests/gpu .dist/
	mkdir -p .dist/fake-nccl && cp target/fake-nccl/libnccl.so.2 .dist/fake-nccl/

# What tests/gpu/vllm_allocator.py needs on a GPU machine that has torch but not vLLM and no
# network, under .dist/vllm (carry .dist): vLLM's Python files from the wheel installed for
# test-vllm (its .py, .json, .yaml and .jinja files; no compiled extension, no C++ headers:
# about 11 MB), vLLM's test files at the tag, and the pure-Python packages its modules import
# that such a machine may lack (VLLM_GPU_WHEELS, for CPython 3.12; the script uses one only
# where the machine has no such module: torch's and transformers' machines have them all).
VLLM_GPU_WHEELS := psutil regex
gpu-vllm: gpu-dist $(VLLM_STAMP) $(VLLM_SRC)/.stamp
	rm -rf .dist/vllm && mkdir -p .dist/vllm/wheels
	site=$$($(VLLM_PY) -c "import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))"); \
	cd $$site && { find vllm \( -name '*.py' -o -name '*.json' -o -name '*.yaml' -o -name '*.jinja' \
		-o -name py.typed \) ! -path '*__pycache__*' ! -path 'vllm/third_party/*/include/*'; \
		echo vllm-$(VLLM_VERSION).dist-info/METADATA; } \
		| tar -czf $(CURDIR)/.dist/vllm/vllm-py.tar.gz -T -
	tar -czf .dist/vllm/vllm-tests.tar.gz -C $(VLLM_SRC) tests
	$(VLLM_PY) -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
		-d .dist/vllm/wheels $(VLLM_GPU_WHEELS)
	du -sh .dist

clean:
	$(CARGO) clean
	rm -rf .dist $(VENV) $(VLLM_VENV) python/memsaver/libmemsaver.so python/memsaver/_fake
