# dscache developer entry points. Run `make help` for the list.
SHELL := bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: help install tools test test-unit bench bench-quick demo e2e kind-down clean

help:
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed ## Python virtualenv with every extra (.venv)

tools: ## Build the Go test binaries into ~/.cache/dscache/tools (first run: see README)
	bash e2e/tools/tools.sh s3 s5cmd etcd kube-apiserver helm

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
