#!/usr/bin/env bash
# Moves the real models to the GPU machine in pieces: it reaches no network and
# one call carries at most 64 MiB together with the working tree (50 MB, of
# which the test fixtures are 43 MB). The machine keeps its files only while it
# stays warm (30 s after a call), so the pieces go in back-to-back calls.
#
#   tools/gpu-stage.sh [MODEL.gguf ...]   # here: one tar of the models, cut into .devstage/NNN/
#
# The plan it prints: the first call carries .devbin and piece 000 with the
# whole tree (it can run the GPU tests too); before the middle calls the
# fixtures are moved out of the tree here (`--hide`), so each carries one
# 54 MB piece; the last carries .devbin and the last piece and runs
#   tools/gpu-stage.sh --assemble /root/stage && TURBOSPARK_MODELS=/root/stage tools/gpu-run.sh real
# and `--unhide` puts the fixtures back here. Each call's command starts with
#   mkdir -p /root/stage && cp .devstage/NNN/* /root/stage/
set -euo pipefail
cd "$(dirname "$0")/.."
hold=/tmp/turbospark-fixtures-hidden
case ${1:-} in
--assemble)
    dir=$2
    cat "$dir"/piece.* | tar -xf - -C "$dir"
    rm -f "$dir"/piece.*
    (cd "$dir" && sha256sum -c models.sha256)
    exit 0
    ;;
--hide)
    mkdir -p "$hold" && mv tests/fixtures "$hold/" && echo "fixtures moved to $hold"
    exit 0
    ;;
--unhide)
    mv "$hold/fixtures" tests/ && echo "fixtures back"
    exit 0
    ;;
esac
models=("$@")
if [[ ${#models[@]} -eq 0 ]]; then
    models=(models/*.gguf)
fi
# 4 MB: the first call also carries .devbin (11 MB with an earlier build beside it) and the
# whole tree (2026-12-07: 16 MB no longer fit).
first=${TURBOSPARK_STAGE_FIRST:-4000000}
# 54 MB: with pieces of 61 MB a call went over its 64 MiB beside the tree (2026-12-07).
piece=${TURBOSPARK_STAGE_PIECE:-54000000}
grep -qx '/.devstage/' .git/info/exclude || echo '/.devstage/' >> .git/info/exclude
rm -rf .devstage
mkdir -p .devstage/tmp
# One tar of the models (from wherever they are) and their checksums, names without folders.
tar_args=()
for m in "${models[@]}"; do
    (cd "$(dirname "$m")" && sha256sum "$(basename "$m")") >> .devstage/tmp/models.sha256
    tar_args+=(-C "$(cd "$(dirname "$m")" && pwd)" "$(basename "$m")")
done
tar -cf .devstage/tmp/all.tar "${tar_args[@]}" -C "$PWD/.devstage/tmp" models.sha256
size=$(stat -c %s .devstage/tmp/all.tar)
at=0
n=0
while ((at < size)); do
    len=$piece
    if ((n == 0)); then len=$first; fi
    d=$(printf ".devstage/%03d" "$n")
    mkdir -p "$d"
    dd if=.devstage/tmp/all.tar of="$d/piece.$(printf %03d "$n")" bs=1M iflag=skip_bytes,count_bytes \
        skip="$at" count="$len" status=none
    at=$((at + len))
    n=$((n + 1))
done
rm -rf .devstage/tmp
echo "$n calls, one folder each (the last one's piece: $(stat -c %s "$d"/piece.*) bytes):"
ls -d .devstage/[0-9]*
