#!/bin/sh
# Set up the peer engines for benchmarks/bench.py, once (idempotent; reruns skip finished steps).
#   PEERS_DIR (default /work/big/peers): where the venvs, the sdist and the build live.
# - $PEERS_DIR/venv: llama-cpp-python 0.3.36 built from its source package, and accelerate 1.15 for
#   transformers' disk offload. It layers on the moestream venv (a .pth line) for torch and transformers,
#   so that no second torch is installed.
# - $PEERS_DIR/convert-venv: llama.cpp's convert_hf_to_gguf.py (shipped in the sdist) with the
#   transformers it pins (4.57) and gguf-py from the same sdist; torch again from the moestream venv.
# The build runs at nice 10 with 2 parallel jobs: it shares the machine.
set -eu
PEERS_DIR=${PEERS_DIR:-/work/big/peers}
BASE_PY=${BASE_PY:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
LLAMA_VERSION=0.3.36
ACCELERATE_VERSION=1.15.0
CONVERT_TRANSFORMERS=4.57.6
for tool in gcc g++ cmake; do
  command -v "$tool" >/dev/null || { echo "setup_peers: $tool not found; llama-cpp-python needs gcc, g++ and cmake" >&2; exit 2; }
done
mkdir -p "$PEERS_DIR"
base_site=$("$BASE_PY" -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
py=$("$BASE_PY" -c 'import sys; print(sys._base_executable)')

make_venv() {  # $1 = venv folder; layers on the moestream venv's site-packages
  if [ ! -x "$1/bin/python" ]; then
    "$py" -m venv "$1"
    site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$base_site" > "$site/moestream-base.pth"
  fi
}

make_venv "$PEERS_DIR/venv"
cd "$PEERS_DIR"
if [ ! -f "llama_cpp_python-$LLAMA_VERSION.tar.gz" ]; then
  "$PEERS_DIR/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION" -d "$PEERS_DIR"
fi
"$PEERS_DIR/venv/bin/python" -c "import accelerate" 2>/dev/null || \
  "$PEERS_DIR/venv/bin/pip" install -q --no-deps "accelerate==$ACCELERATE_VERSION" psutil

# The converter: unpack the sdist's llama.cpp tree (convert_hf_to_gguf.py + gguf-py).
if [ ! -f "$PEERS_DIR/src/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  rm -rf "$PEERS_DIR/src" && mkdir -p "$PEERS_DIR/src"
  tar -xzf "llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$PEERS_DIR/src" --strip-components=1
fi
make_venv "$PEERS_DIR/convert-venv"
if ! "$PEERS_DIR/convert-venv/bin/python" -c "import gguf, transformers; assert transformers.__version__.startswith('4.57')" 2>/dev/null; then
  "$PEERS_DIR/convert-venv/bin/pip" install -q "transformers==$CONVERT_TRANSFORMERS" sentencepiece "protobuf<5" \
    "$PEERS_DIR/src/vendor/llama.cpp/gguf-py"
fi
if ! "$PEERS_DIR/venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "setup_peers: building llama-cpp-python $LLAMA_VERSION (many minutes on 2 cores)"
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON} \
    nice -n 10 "$PEERS_DIR/venv/bin/pip" install -q "$PEERS_DIR/llama_cpp_python-$LLAMA_VERSION.tar.gz"
fi
"$PEERS_DIR/convert-venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13'), torch.__version__"
"$PEERS_DIR/venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13'), torch.__version__"
echo "setup_peers: ready in $PEERS_DIR"
