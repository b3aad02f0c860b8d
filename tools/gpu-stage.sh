#!/usr/bin/env bash
# Splits the real models into pieces small enough to ride along with device
# calls (a call carries at most 64 MiB together with the working tree, about
# 45 MB here), into .devstage/ (git-ignored). The GPU machine keeps its files
# only while it stays warm (30 s after a call), so the pieces must go in
# back-to-back calls, each carrying one folder:
#
#   tools/gpu-stage.sh [MODEL.gguf ...]        # here: writes .devstage/NN/ folders, prints the plan
#   device run, carry [".devstage/NN"], command:
#       mkdir -p /root/stage && cp .devstage/NN/* /root/stage/
#   last call, carry [".devbin"], command:
#       tools/gpu-stage.sh --assemble /root/stage && \
#       TURBOSPARK_MODELS=/root/stage tools/gpu-run.sh real
set -euo pipefail
cd "$(dirname "$0")/.."
piece=${TURBOSPARK_STAGE_PIECE_MB:-17}
if [[ ${1:-} == --assemble ]]; then
    dir=$2
    for sha in "$dir"/*.sha256; do
        name=$(basename "$sha" .sha256)
        cat "$dir/$name".part.* > "$dir/$name"
        (cd "$dir" && sha256sum -c "$name.sha256")
        rm -f "$dir/$name".part.*
    done
    exit 0
fi
models=("$@")
if [[ ${#models[@]} -eq 0 ]]; then
    # SmolLM2 alone is 6 calls; all three real models are about 50.
    models=(models/smollm2-135m-instruct-q4_1.gguf)
fi
grep -qx '/.devstage/' .git/info/exclude || echo '/.devstage/' >> .git/info/exclude
rm -rf .devstage
mkdir -p .devstage/all
for m in "${models[@]}"; do
    name=$(basename "$m")
    split -b "${piece}M" -d -a 3 "$m" ".devstage/all/$name.part."
    (cd "$(dirname "$m")" && sha256sum "$name") > ".devstage/all/$name.sha256"
done
# One folder per call: pieces (and checksums) up to the piece size each.
n=0
for f in .devstage/all/*; do
    d=$(printf ".devstage/%03d" "$n")
    mkdir -p "$d"
    mv "$f" "$d/"
    if [[ $f != *.sha256 ]]; then n=$((n + 1)); fi
done
rmdir .devstage/all
echo "$(ls -d .devstage/[0-9]* | wc -l) calls, one folder each:"
ls -d .devstage/[0-9]*
