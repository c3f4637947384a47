#!/bin/sh
# Set up the peer engines for benchmarks/bench.py, once (idempotent; reruns skip finished steps).
#   PEERS_DIR (default /work/big/peers): where the venvs, the sdist and the build live.
# - $PEERS_DIR/venv: llama-cpp-python 0.3.36 built from its source package, accelerate 1.15 for
#   transformers' disk offload, and fastllm (ftllm 1.9.0, --no-deps, with numpy, pillow, jinja2). It layers on the moestream venv (a .pth line) for torch and transformers,
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
FTLLM_VERSION=1.9.0
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
# fastllm: its wheel carries its own CPU library; --no-deps keeps it from pulling a torch
"$PEERS_DIR/venv/bin/python" -c "import ftllm" 2>/dev/null || \
  { "$PEERS_DIR/venv/bin/pip" install -q --no-deps "ftllm==$FTLLM_VERSION" && \
    "$PEERS_DIR/venv/bin/pip" install -q numpy pillow jinja2; }

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
  # The package's own build (pip install of the sdist) also compiles llama.cpp's common library and the
  # multimodal mtmd library, about 100 objects the benchmark never loads (over an hour on 2 shared cores).
  # So: the Python package with its native build off, then libllama and ggml from the same sdist's
  # llama.cpp tree with the package's settings (Release, GGML_NATIVE, shared libraries), target llama only.
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PEERS_DIR/venv/bin/pip" install -q \
    "$PEERS_DIR/llama_cpp_python-$LLAMA_VERSION.tar.gz"
  echo "setup_peers: building libllama from llama-cpp-python $LLAMA_VERSION's llama.cpp (many minutes on 2 cores)"
  cmake -S "$PEERS_DIR/src/vendor/llama.cpp" -B "$PEERS_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' > "$PEERS_DIR/cmake-configure.log"
  nice -n 10 cmake --build "$PEERS_DIR/build" --target llama -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
  lib=$("$PEERS_DIR/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/llama_cpp/lib
  mkdir -p "$lib" && cp -P "$PEERS_DIR"/build/bin/lib*.so* "$lib/"
fi
"$PEERS_DIR/convert-venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13'), torch.__version__"
"$PEERS_DIR/venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13'), torch.__version__"
echo "setup_peers: ready in $PEERS_DIR"
