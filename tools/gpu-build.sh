#!/usr/bin/env bash
# Builds, here, what tools/gpu-run.sh runs on the GPU machine: the release
# turbospark binary, the CUDA test binaries (their tests are #[ignore]d on CI,
# which has no GPU; gpu-run.sh runs them with --include-ignored) and the
# bandwidth probe, in .devbin/ (ignored by git; name it in the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
# .devbin/ stays out of git: it travels to the GPU machine where `carry` names it.
if exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then
    mkdir -p "$(dirname "$exclude")"
    grep -qsx '/.devbin/' "$exclude" || echo '/.devbin/' >> "$exclude"
fi
mkdir -p .devbin
cargo build --release -p turbospark
cargo build --release -p ts-cuda --examples
cargo build --release -p ts-cpu --example team_regions
cp "$target"/release/turbospark "$target"/release/examples/bandwidth "$target"/release/examples/team_regions .devbin/
# The executable of ts-cuda's integration test $1.
test_bin() {
    cargo test --release -p ts-cuda --test "$1" --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]==sys.argv[1] and m.get("executable"): print(m["executable"])' "$1"
}
cp "$(test_bin gpu)" .devbin/gpu-tests
# dequant_host: its NVRTC check is the one CI cannot run.
cp "$(test_bin dequant_host)" .devbin/cuda-host-tests
strip .devbin/turbospark .devbin/bandwidth .devbin/team_regions .devbin/gpu-tests .devbin/cuda-host-tests
# Compressed, so that they and the tree fit a call's 64 MiB (gpu-run.sh unpacks them).
# An earlier commit's binary for before/after runs goes in as turbospark-before (and its
# team_regions as team_regions-before, which `cpu-sweep` runs beside this one).
xz -f -T0 .devbin/turbospark .devbin/bandwidth .devbin/team_regions .devbin/gpu-tests .devbin/cuda-host-tests
ls -la .devbin
