#!/usr/bin/env bash
# Memory pressure: `--cache-budget-gb auto` inside a cgroup memory cap smaller than the
# checkpoint. Three runs, each in a fresh cgroup of the same cap:
#   1. a long generation (--max-tokens 1000, sampled, so it does not stop early),
#   2. a long prompt (--prompt-tokens, default 4096) with a short answer,
#   3. a fixed budget that cannot fit in the cap: refused before any weight is read.
# Reports for each: exit status (137 = killed by the OOM killer), OOM kills counted by the
# cgroup, peak memory charged to the cap, the auto budget's numbers, the run's stats.
# Needs root (cgroups). The checkpoint is written by `moestream synth` when missing
# (Qwen3-30B-A3B shape, --layers 2: 3.7 GB in bf16); delete it when done.
#
#   benchmarks/memory_pressure.sh [--cap 3G] [--model DIR] [--layers 2] [--tokens 1000]
#                                 [--prompt-tokens 4096] [--refuse-budget 3]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cap=3G model=${MOESTREAM_BENCH_DIR:-/var/tmp/moestream-bench}/qwen3-30b-a3b-2l layers=2 tokens=1000
prompt_tokens=4096 refuse=3
config=${CONFIG:-$here/../shared/models/configs/Qwen3-30B-A3B.json}
while [ $# -gt 0 ]; do
  case $1 in
    --cap) cap=$2; shift 2 ;; --model) model=$2; shift 2 ;; --layers) layers=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;; --prompt-tokens) prompt_tokens=$2; shift 2 ;;
    --refuse-budget) refuse=$2; shift 2 ;; --config) config=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
. "$here/benchmarks/_common.sh"
ensure_checkpoint "$config" "$model" "$layers"
[ -d /sys/fs/cgroup/memory ] || { echo "needs cgroup v1 memory (see benchmarks/capped_run.sh for v2)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# a long prompt of varied English words, about one token each
"$bin/python" - "$prompt_tokens" > "$work/prompt.txt" <<'EOF'
import random, sys
words = ("the river light stone north garden window paper silver market winter quiet engine signal harbor "
         "letter orange forest bridge morning number glass story kitchen planet violin summer ladder").split()
rng = random.Random(0)
print(" ".join(rng.choice(words) for _ in range(int(sys.argv[1]))))
EOF

run() {  # name, then the generate flags
  local name=$1; shift
  local cg=/sys/fs/cgroup/memory/moestream-pressure-$$-$name
  mkdir "$cg"; echo "$cap" > "$cg/memory.limit_in_bytes"
  local stats=$work/$name.json status=0
  local t0; t0=$(date +%s)
  sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$cg" \
    "$bin/moestream" generate --model "$model" --stats-json "$stats" "$@" \
    > "$work/$name.out" 2> "$work/$name.err" || status=$?
  local t1; t1=$(date +%s)
  local oom; oom=$(awk '/^oom_kill /{print $2}' "$cg/memory.oom_control"); oom=${oom:-n/a}
  echo "== $name: exit $status, $((t1 - t0)) s, OOM kills $oom, peak charged to the $cap cap:" \
       "$(( $(cat "$cg/memory.max_usage_in_bytes") / 1000000 )) MB (RSS + page cache)"
  grep -E "^(cache budget auto|expert reads|moestream: error)" "$work/$name.err" || true
  [ -s "$stats" ] && "$bin/python" - "$stats" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
keys = ("prompt_tokens", "generated_tokens", "finish_reason", "prefill_tok_s", "decode_tok_s", "cache_budget_gb",
        "cache_peak_gb", "cache_hit_rate", "gb_read", "resident_weight_gb", "peak_rss_gb")
print("   " + ", ".join(f"{k} {s[k]:.3g}" if isinstance(s[k], float) else f"{k} {s[k]}" for k in keys if k in s))
EOF
  rmdir "$cg"
}

echo "cap $cap; checkpoint $(du -sh "$model" | cut -f1) ($model)"
run long-generation --cache-budget-gb auto --max-tokens "$tokens" --temp 1 --seed 0 \
    --prompt "Write a long story about a lighthouse keeper."
run long-prompt --cache-budget-gb auto --max-tokens 16 --temp 1 --seed 0 --no-chat-template \
    --prompt-file "$work/prompt.txt"
run too-big-budget --cache-budget-gb "$refuse" --max-tokens 4 --prompt "hi"
