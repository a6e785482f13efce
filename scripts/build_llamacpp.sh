#!/usr/bin/env bash
# Build llama.cpp's `llama-batched-bench`, `llama-server` and `llama-quantize` (CPU only) from the llama.cpp source vendored in
# the llama-cpp-python sdist on PyPI, once, into .cache/llamacpp/ (git-ignored). Used by `make bench-llamacpp`.
#
#   bash scripts/build_llamacpp.sh            # idempotent: does nothing when the binaries exist
#   LLAMACPP_JOBS=4 bash scripts/build_llamacpp.sh
#
# Environment: LLAMACPP_PYTHON_VERSION (the sdist pin), LLAMACPP_JOBS (parallel compile jobs, default 2),
# MINIVLLM_LLAMACPP_DIR (where to build; default <repo>/.cache/llamacpp), PYTHON (a python with pip).
set -euo pipefail

VERSION="${LLAMACPP_PYTHON_VERSION:-0.3.36}"
JOBS="${LLAMACPP_JOBS:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MINIVLLM_LLAMACPP_DIR:-$ROOT/.cache/llamacpp}"
SRC="$CACHE/llama_cpp_python-$VERSION"
BUILD="$CACHE/build-$VERSION"
BIN="$BUILD/bin"
TARGETS=(llama-batched-bench llama-server llama-quantize)

log() { echo "[build_llamacpp] $*" >&2; }

built() { for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done; }
if built; then
    log "already built: ${TARGETS[*]} in $BIN (delete $BUILD to rebuild)"
    exit 0
fi

for tool in cmake c++ tar; do
    command -v "$tool" >/dev/null || { log "missing '$tool': install it first (e.g. apt-get install cmake g++)"; exit 1; }
done
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
mkdir -p "$CACHE"
start=$(date +%s)

sdist="$(ls "$CACHE"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [[ -z "$sdist" ]]; then
    log "downloading the llama-cpp-python==$VERSION sdist from PyPI into $CACHE"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --dest "$CACHE" "llama-cpp-python==$VERSION"
    sdist="$CACHE/llama_cpp_python-$VERSION.tar.gz"
fi
if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    log "extracting $(basename "$sdist")"
    tar -xzf "$sdist" -C "$CACHE"
fi
LLAMA_SRC="$SRC/vendor/llama.cpp"
[[ -f "$LLAMA_SRC/CMakeLists.txt" ]] || { log "no vendor/llama.cpp in $sdist"; exit 1; }

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
log "configuring $LLAMA_SRC -> $BUILD"
cmake -S "$LLAMA_SRC" -B "$BUILD" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_COMMON=ON \
    -DGGML_BUILD_TESTS=OFF \
    -DGGML_BUILD_EXAMPLES=OFF \
    >"$CACHE/configure.log" 2>&1 || { tail -40 "$CACHE/configure.log" >&2; log "configure failed (log: $CACHE/configure.log)"; exit 1; }

log "building ${TARGETS[*]} with -j$JOBS (about 10+ minutes on 2 cores; log: $CACHE/build.log)"
cmake --build "$BUILD" --config Release -j"$JOBS" --target "${TARGETS[@]}" 2>&1 | tee "$CACHE/build.log" |
    grep --line-buffered -E '^\[[0-9]+/[0-9]+\]|error' | awk '{ print "[build_llamacpp] " $0; fflush() }' >&2 || true
for t in "${TARGETS[@]}"; do
    [[ -x "$BIN/$t" ]] || { tail -40 "$CACHE/build.log" >&2; log "build failed: no $BIN/$t"; exit 1; }
done
log "built in $(( $(date +%s) - start ))s: ${TARGETS[*]} in $BIN"
