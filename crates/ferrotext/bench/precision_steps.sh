#!/usr/bin/env bash
# bf16 against f32 step time, alternated in one sitting (ABBA pairs), from each run's
# metrics.jsonl (median step after 2 warm-up steps). Usage:
#   crates/ferrotext/bench/precision_steps.sh PAIRS OUT.json key=value...   (the run's keys)
# e.g. crates/ferrotext/bench/precision_steps.sh 3 target/bench/precision-4x4.json \
#        model_name=qwen3-peer max_target_length=64 per_device_batch_size=2 \
#        ici_data_parallelism=4 local_devices=4 gradient_accumulation_steps=4 steps=10
set -euo pipefail
pairs=$1; out=$2; shift 2
exe=${FERROTEXT:-target/release/ferrotext}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median() { python3 -c "
import json,statistics,sys
s=[json.loads(l)['seconds'] for l in open(sys.argv[1]) if '\"seconds\"' in l][2:]
print(statistics.median(s))" "$1"; }
rows=()
for p in $(seq 1 "$pairs"); do
  order="float32 bfloat16"; [ $((p % 2)) -eq 0 ] && order="bfloat16 float32"
  declare -A t=()
  for dt in $order; do
    /usr/bin/time -f "%e %U %S %M" -o "$work/time" "$exe" train "$@" dtype=$dt \
      base_output_directory="$work" run_name="$dt-$p" >/dev/null
    read -r wall user sys rss <"$work/time"
    t[$dt]=$(median "$work/$dt-$p/metrics.jsonl")
    rows+=("{\"pair\":$p,\"dtype\":\"$dt\",\"median_step_s\":${t[$dt]},\"wall_s\":$wall,\"user_s\":$user,\"sys_s\":$sys,\"peak_rss_kb\":$rss}")
    echo "pair $p $dt: median step ${t[$dt]} s, user $user s, sys $sys s, peak RSS $rss KB"
  done
  echo "pair $p bf16/f32: $(python3 -c "print(round(${t[bfloat16]}/${t[float32]},3))")"
done
mkdir -p "$(dirname "$out")"
printf '{"benchmark":"precision_steps","keys":"%s","runs":[%s]}\n' "$*" "$(IFS=,; echo "${rows[*]}")" >"$out"
echo "wrote $out"
