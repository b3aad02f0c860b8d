#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer test vocabularies (models/ggml-vocab-*.gguf and
# their .inp/.out test vectors) from the source distribution of the PyPI
# package llama-cpp-python, which vendors llama.cpp, into
# $TURBOSPARK_MODELS/vocab (default: ./models/vocab). Idempotent: when the
# files of this version are already there, nothing is downloaded.
set -euo pipefail
version=0.3.36
sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${TURBOSPARK_MODELS:-$root/models}/vocab
marker="$dest/.llama-cpp-python-$version"
if [ -f "$marker" ]; then
  echo "ok      $dest (llama-cpp-python $version)"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "fetch   llama-cpp-python==$version (sdist)"
# pip reads the sdist's metadata through its build backend (scikit-build-core,
# which wants CMake); without build isolation both must be importable, so a
# throwaway venv provides them when the current Python lacks them.
python=python3
if ! python3 -c "import scikit_build_core, cmake" 2>/dev/null; then
  python3 -m venv "$work/venv"
  python="$work/venv/bin/python"
  "$python" -m pip install -q "scikit-build-core==1.1.2" "cmake==4.4.5"
fi
"$python" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation "llama-cpp-python==$version" -d "$work"
sdist="$work/llama_cpp_python-$version.tar.gz"
if ! echo "$sha  $sdist" | sha256sum -c --status; then
  echo "sha256 mismatch for $(basename "$sdist")" >&2
  exit 1
fi
tar -xzf "$sdist" -C "$work" --wildcards "llama_cpp_python-$version/vendor/llama.cpp/models/ggml-vocab-*"
mkdir -p "$dest"
mv -f "$work/llama_cpp_python-$version/vendor/llama.cpp/models/"ggml-vocab-* "$dest/"
touch "$marker"
echo "ok      $dest ($(ls "$dest" | grep -c '\.gguf$') vocabularies)"
