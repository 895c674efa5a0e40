# dscache developer entry points. Run `make help` for the list.
SHELL := bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: help install wheels lock lint chart-docs docs release-check tools test test-unit bench bench-quick demo e2e kind-down clean

help:
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

# uv.lock is the one lock: the venv installs its export of every extra (hashed),
# the images install operator/requirements.txt and init-container/requirements.txt,
# its exports for one extra each. `make lock` refreshes all three.
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
EXPORT := $(UV) export --frozen --no-emit-project --quiet

$(VENV)/.installed: pyproject.toml uv.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "uv==$(UV_VERSION)"
	$(EXPORT) --all-extras --no-dev -o $(VENV)/requirements.txt
	$(PY) -m pip install -q --require-hashes --no-deps -r $(VENV)/requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# The stager's native data plane (native/, Rust + PyO3, built by maturin from
# crates.io: no prebuilt binary), for the venv. Optional here: without cargo,
# or when the build fails, the venv's stager runs its pure-Python data plane
# (DSCACHE_NATIVE in dscache_stager/native.py). The stager image does not use
# this wheel: its Dockerfile's native stage compiles its own for the image's
# architecture, and the image does not build without it.
# maturin, pinned and hashed: the same file the image's build installs.
MATURIN_REQ := init-container/build-requirements.txt
# Compiled crates are kept outside the clone, so a fresh clone (CI) builds only
# this crate, not its ~150 dependencies (a cold build: see init-container/README.md).
export CARGO_TARGET_DIR ?= $(HOME)/.cache/dscache/native-target
WHEELS := build/wheels
# Fixed zip timestamps: the same sources make the same wheel.
WHEEL_EPOCH := 1700000000
NATIVE_SRC := $(wildcard native/Cargo.toml native/Cargo.lock native/pyproject.toml native/*.pyi native/src/*.rs)

build/wheels.stamp: $(NATIVE_SRC) $(MATURIN_REQ) | $(VENV)/.installed
	@command -v cargo >/dev/null || { echo "make wheels: cargo not found (rustup, or Debian's cargo)" >&2; exit 1; }
	@[ -x $(VENV)/bin/maturin ] || $(PY) -m pip install -q --require-hashes --no-deps -r $(MATURIN_REQ)
	rm -rf $(WHEELS) && mkdir -p $(WHEELS)
	@# abi3 (CPython >= 3.11) and this machine's glibc: the image's base is the same Debian.
	t=$$(date +%s); cd native && SOURCE_DATE_EPOCH=$(WHEEL_EPOCH) ../$(VENV)/bin/maturin build --release --locked --quiet \
	  --interpreter ../$(PY) --compatibility linux --out ../$(WHEELS) \
	  && echo "make wheels: built in $$(( $$(date +%s) - t ))s: $$(ls ../$(WHEELS))"
	touch $@

wheels: build/wheels.stamp ## The native data plane's wheel for the venv (Rust, maturin) into build/wheels/

install: $(VENV)/.installed ## Python virtualenv with every extra, as locked in uv.lock (.venv), plus the native wheel if it builds
	@if $(MAKE) --no-print-directory wheels; then \
	  $(PY) -m pip install -q --no-deps --force-reinstall $(WHEELS)/*.whl; \
	else \
	  echo "make install: the native wheel did not build; the stager uses its pure-Python data plane" >&2; \
	fi

lock: ## Re-resolve uv.lock from pyproject.toml and export the images' requirements
	@[ -x $(UV) ] || $(PY) -m pip install -q "uv==$(UV_VERSION)"
	$(UV) lock
	$(EXPORT) --no-dev --extra operator -o operator/requirements.txt
	$(EXPORT) --no-dev --extra stager -o init-container/requirements.txt

# The shipped packages are type-checked strictly (pyproject.toml [tool.mypy]).
lint: install ## ruff (lint + format check) and mypy over the shipped packages
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy init-container/dscache_stager node-agent/dscache_node operator/dscache_operator contract/dscache_contract

tools: ## Build the Go test binaries into ~/.cache/dscache/tools (first run: see README)
	bash e2e/tools/tools.sh s3 s5cmd etcd kube-apiserver helm helm-docs actionlint toxiproxy vegeta csi-sanity

# pytest exits 5 when it collects nothing; for us that is a broken suite, not a pass.
define run_pytest
	@$(PY) -m pytest $(1); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests in '$(1)': treating as failure" >&2; exit 1; fi; \
	exit $$rc
endef

test: install tools ## Unit + integration tests (real S3 server, real kube-apiserver)
	$(call run_pytest,tests)

test-unit: install ## Unit tests only (no servers)
	$(call run_pytest,tests/unit)

bench: install tools ## Benchmarks, full size; the last line of each is JSON
	$(PY) bench/stager.py
	$(PY) bench/operator.py

bench-quick: install tools ## Benchmarks, quick mode (each under 10 minutes)
	$(PY) bench/stager.py --quick
	$(PY) bench/operator.py --quick

e2e: install ## End-to-end suite on a 3-node kind cluster with JobSet and Kubeflow (root; e2e/kind/README.md); writes build/e2e-result.json
	bash e2e/run.sh

kind-down: ## Delete the kind cluster, its S3 container and our dockerd (leaves the machine as it was)
	bash e2e/kind/down.sh

NODES ?= 1
demo: install ## kind cluster, sample bucket, a training Job staged end to end, then wiped (NODES=3: + a JobSet on the 3 nodes)
	NODES=$(NODES) bash e2e/demo.sh

clean:
	rm -rf $(VENV) build .pytest_cache

chart-docs: ## Regenerate charts/dscache/README.md from values.yaml and README.md.gotmpl (helm-docs)
	"$$(bash e2e/tools/tools.sh --path helm-docs | tail -1)/helm-docs" --chart-search-root charts/dscache --template-files README.md.gotmpl

docs: ## Render the benchmark figures in README.md and docs/*.md from bench/results/*.json (after `make bench-quick`)
	$(PY) bench/render.py

# The release's images, built here the way release.yml builds them (the same
# Dockerfiles; buildah instead of buildx, this machine's arch only), tagged
# with the version release.yml would publish.
VERSION = $(shell $(PYTHON) -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
IMAGES := bash e2e/tools/images.sh
# In the stager image, as its own user: the wheel its native stage compiled is
# installed, imports, and is the data plane the stager's loader picks.
define NATIVE_CHECK
import platform, dscache_native
from dscache_stager import native
assert native.load() is dscache_native, "the stager would not use dscache_native"
ext = getattr(dscache_native, "dscache_native", dscache_native).__file__
print(f"release-check: dscache_native {dscache_native.version()} ({platform.machine()}), {ext}: the stager's data plane")
endef
export NATIVE_CHECK

release-check: lint test-unit ## What release.yml does that can run here: lint, unit tests, actionlint, helm lint/package, both images built (buildah) and the stager's native wheel imported in its image
	"$$(bash e2e/tools/tools.sh --path actionlint | tail -1)/actionlint" .github/workflows/release.yml
	"$$(bash e2e/tools/tools.sh --path helm | tail -1)/helm" lint --strict charts/dscache
	"$$(bash e2e/tools/tools.sh --path helm | tail -1)/helm" package charts/dscache --destination build
	$(IMAGES) build localhost/dscache-operator:$(VERSION) operator/Dockerfile .
	$(IMAGES) build localhost/dscache-stager:$(VERSION) init-container/Dockerfile .
	$(IMAGES) run localhost/dscache-operator:$(VERSION) python -c 'import dscache_operator, dscache_contract'
	$(IMAGES) run localhost/dscache-stager:$(VERSION) python3 -c "$$NATIVE_CHECK"
