#!/usr/bin/env bash
# Runs a command inside a memory cgroup (v1, as on these machines) whose limit
# covers the page cache too, after dropping the page cache; removes the group
# afterwards. Optionally sets the disk read-ahead for the run (restored after).
#
# usage: tools/memlimit.sh LIMIT [--readahead-kb N] -- COMMAND...
#   LIMIT like 5G, 5120M or bytes. Needs root (it writes /sys/fs/cgroup and /proc/sys/vm).
# Prints the group's peak usage (memory.max_usage_in_bytes) to stderr at the end.
set -euo pipefail
limit=$1; shift
readahead=""
if [ "${1:-}" = "--readahead-kb" ]; then readahead=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "usage: $0 LIMIT [--readahead-kb N] -- COMMAND..." >&2; exit 2; }

root=/sys/fs/cgroup/memory
[ -d "$root" ] || { echo "no cgroup v1 memory controller at $root" >&2; exit 1; }
group="$root/turbospark-$$"
mkdir "$group"
dev=$(lsblk -no PKNAME "$(findmnt -no SOURCE --target "$PWD")" 2>/dev/null || true)
[ -n "$dev" ] || dev=$(basename "$(findmnt -no SOURCE --target "$PWD")")
ra_file="/sys/block/$dev/queue/read_ahead_kb"
old_ra=""
cleanup() {
  if [ -n "$old_ra" ]; then echo "$old_ra" > "$ra_file"; fi
  # Move this shell back to the root group so the group can go.
  echo $$ > "$root/cgroup.procs" 2>/dev/null || true
  rmdir "$group" 2>/dev/null || true
}
trap cleanup EXIT
if [ -n "$readahead" ] && [ -w "$ra_file" ]; then old_ra=$(cat "$ra_file"); echo "$readahead" > "$ra_file"; fi

case "$limit" in
  *G|*g) bytes=$(( ${limit%[Gg]} * 1024 * 1024 * 1024 )) ;;
  *M|*m) bytes=$(( ${limit%[Mm]} * 1024 * 1024 )) ;;
  *) bytes=$limit ;;
esac
echo "$bytes" > "$group/memory.limit_in_bytes"
# No swap on these machines; forbid it anyway so the limit is real.
echo "$bytes" > "$group/memory.memsw.limit_in_bytes" 2>/dev/null || true
sync
echo 3 > /proc/sys/vm/drop_caches
echo $$ > "$group/cgroup.procs"
status=0
"$@" || status=$?
echo "memlimit: limit $bytes bytes, peak $(cat "$group/memory.max_usage_in_bytes") bytes, read-ahead $(cat "$ra_file" 2>/dev/null || echo '?') KB, exit $status" >&2
exit $status
