#!/usr/bin/env bash
# Build llama.cpp (through llama-cpp-python, compiled from its sdist, CPU only) into its own
# virtual environment, with what llama.cpp's HF -> GGUF converter needs, for
# benchmarks/peers/llamacpp_decode.py:
#
#     benchmarks/peers/llamacpp_setup.sh [VENV_DIR]        # default /tmp/llamacpp-venv
#
# Environment: LLAMACPP_VERSION (default 0.3.36), CMAKE_ARGS (default -DGGML_NATIVE=ON
# -DLLAVA_BUILD=OFF: tuned to this CPU, no multimodal library).
# The unpacked sdist is kept at VENV_DIR/src/llama_cpp_python-VERSION; its
# vendor/llama.cpp/convert_hf_to_gguf.py is the converter that matches the built library.
set -euo pipefail

VENV=${1:-/tmp/llamacpp-venv}
VERSION=${LLAMACPP_VERSION:-0.3.36}
SRC=$VENV/src
PY=$VENV/bin/python

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip

# The sdist, unpacked where the benchmark looks for the converter.
mkdir -p "$SRC"
"$PY" -m pip download --quiet --no-binary :all: --no-deps -d "$SRC" "llama-cpp-python==$VERSION"
SDIST=$SRC/llama_cpp_python-$VERSION.tar.gz
tar -xzf "$SDIST" -C "$SRC"
LLAMA=$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp

# torch (the converter imports it) pinned to 2.13.0, CPU build: take what pip resolves when
# that is a +cpu build (a local wheel cache), else PyTorch's CPU index, never PyPI's CUDA one.
torch_version=$("$PY" -m pip install --dry-run --no-deps --quiet --report - torch==2.13.0 |
    "$PY" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])')
if [[ $torch_version == *+cpu ]]; then
    "$PY" -m pip install --quiet torch==2.13.0
else
    "$PY" -m pip install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi

# The converter's own pins (numpy, sentencepiece, transformers, protobuf) less torch and its
# index line, and the gguf-py shipped beside it rather than PyPI's.
grep -Ev '^(torch|gguf|--|-r|#)|^$' "$LLAMA/requirements/requirements-convert_legacy_llama.txt" \
    > "$SRC/converter-requirements.txt"
"$PY" -m pip install --quiet -r "$SRC/converter-requirements.txt" "$LLAMA/gguf-py"

# The library itself, compiled from the sdist (a wheel is never used).
export CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAVA_BUILD=OFF}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
start=$(date +%s)
nice -n 19 "$PY" -m pip install --no-binary llama-cpp-python "$SDIST"
echo "llama-cpp-python $VERSION built in $(( $(date +%s) - start )) s (CMAKE_ARGS=$CMAKE_ARGS)"

"$PY" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())'
echo "venv:      $VENV"
echo "converter: $LLAMA/convert_hf_to_gguf.py"
