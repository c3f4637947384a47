#!/usr/bin/env bash
# Stream a synth Qwen3-30B-A3B-shaped checkpoint inside a memory cap smaller than a third
# of the checkpoint, from a cold page cache, and report the stats and the cap's peak.
# Needs root (cgroup and drop_caches). Reproduces the README's "bigger than memory" run.
#
#   benchmarks/capped_run.sh [--cap 8G] [--model DIR] [--layers N] [--budget 2] [--tokens 128]
#
# The checkpoint is written by `moestream synth` when DIR does not exist yet (61 GB for all
# 48 layers in bf16); delete it when done.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cap=8G model=${MOESTREAM_BENCH_DIR:-/var/tmp/moestream-bench}/qwen3-30b-a3b layers="" budget=2 tokens=128
config=${CONFIG:-$here/../shared/models/configs/Qwen3-30B-A3B.json}
while [ $# -gt 0 ]; do
  case $1 in
    --cap) cap=$2; shift 2 ;; --model) model=$2; shift 2 ;; --layers) layers=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;; --tokens) tokens=$2; shift 2 ;; --config) config=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
. "$here/benchmarks/_common.sh"
ensure_checkpoint "$config" "$model" "$layers"
name=moestream-bench-$$
if [ -d /sys/fs/cgroup/memory ]; then  # cgroup v1
  cg=/sys/fs/cgroup/memory/$name; mkdir "$cg"; echo "$cap" > "$cg/memory.limit_in_bytes"
  peak_file=$cg/memory.max_usage_in_bytes
else  # cgroup v2
  cg=/sys/fs/cgroup/$name; mkdir "$cg"; echo "$cap" > "$cg/memory.max"
  peak_file=$cg/memory.peak
fi
trap 'rmdir "$cg" 2>/dev/null || true' EXIT
sync; echo 3 > /proc/sys/vm/drop_caches
stats=$(mktemp --suffix .json)
cmd=("$bin/moestream" generate --model "$model" --max-tokens "$tokens" --cache-budget-gb "$budget"
     --temp 1 --seed 0 --stats-json "$stats"
     --prompt "Write a short story about a lighthouse keeper who finds a message in a bottle.")
echo "cap $cap; checkpoint $(du -sh "$model" | cut -f1); command: ${cmd[*]}" >&2
sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$cg" "${cmd[@]}"
echo "peak memory charged to the cap (RSS + page cache): $(( $(cat "$peak_file") / 1000000 )) MB" >&2
cat "$stats"
