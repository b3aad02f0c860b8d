#!/usr/bin/env bash
# Packs ik_llama.cpp's sources (the fastest CPU peer, with its own CUDA backend) pruned to what
# its llama-bench needs with the CPU and CUDA backends into .peer/ik-cuda.tar.xz (about 4 MB),
# for `tools/gpu-run.sh peer-build` on the GPU machine.
# Usage: tools/peer-pack-ik.sh [GIT_DIR]   (default: the `fetch` mirror of ikawrakow/ik_llama.cpp)
# The mirror may lack its largest blobs: files are taken one by one, the absent ones skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
git_dir=${1:-/work/.mirror/ikawrakow+ik_llama.cpp/repo}
stage=$(mktemp -d)
python3 - "$git_dir" "$stage/ik_llama.cpp" <<'PY'
import os, subprocess, sys
git_dir, root = sys.argv[1], sys.argv[2]
skip = ('pocs/', 'docs/', 'media/', 'models/', 'tests/', 'ggml/src/ggml-sycl', 'ggml/src/vulkan-shaders',
        'ggml/src/ggml-cann', 'gguf-py/', '.github/', '.devops/', 'docker/', 'examples/server/public',
        'examples/server/webui', 'github-data/', 'ci/', 'scripts/')
tree = subprocess.run(['git', '-C', git_dir, 'ls-tree', '-r', 'HEAD'], check=True, capture_output=True, text=True).stdout
cat = subprocess.Popen(['git', '-C', git_dir, 'cat-file', '--batch'], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
kept = 0
for line in tree.splitlines():
    meta, path = line.split('\t', 1)
    mode, kind, obj = meta.split()
    if kind != 'blob' or path.startswith(skip):
        continue
    cat.stdin.write((obj + '\n').encode())
    cat.stdin.flush()
    header = cat.stdout.readline().split()
    if header[-1] == b'missing':
        continue
    data = cat.stdout.read(int(header[2]))
    cat.stdout.read(1)
    dst = os.path.join(root, path)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if mode == '120000':
        os.symlink(data.decode(), dst)
    else:
        with open(dst, 'wb') as f:
            f.write(data)
        if mode == '100755':
            os.chmod(dst, 0o755)
    kept += 1
print(f'{kept} files', file=sys.stderr)
PY
# pocs/ is not packed: its add_subdirectory goes.
sed -i '/add_subdirectory(pocs)/d' "$stage/ik_llama.cpp/CMakeLists.txt"
exclude=$(git rev-parse --git-path info/exclude)
grep -qsx '/.peer/' "$exclude" || echo '/.peer/' >> "$exclude"
mkdir -p .peer
tar -cJf .peer/ik-cuda.tar.xz -C "$stage" ik_llama.cpp
rm -rf "$stage"
ls -la .peer/ik-cuda.tar.xz
