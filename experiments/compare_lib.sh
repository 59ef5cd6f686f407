# Sourced by the comparison scripts (experiments/*/compare.sh): their arguments, seeds, one run per
# method and seed, and the report.
#   source compare_lib.sh; parse_comparison "$@"   # sets out, seeds, overrides
#   run_method NAME CONFIG [overrides...]           # into OUT/NAME, or OUT/NAME-seed<k> with several seeds;
#                                                   # a finished run is kept, an interrupted one resumed
#   write_report                                    # OUT/report; several seeds: mean ± std per method
# HFL_PARALLEL=N runs up to N runs at once in the background (runs sharing one GPU; one per CPU core at
# most: each needs a core), each logging to OUT/NAME.log and, with HFL_RUN_LIMIT=SECONDS, stopped after
# that long (its metrics.jsonl keeps every round it reached; the script run again resumes it);
# write_report waits for them.
seeds=(0)
runs=()
overrides=()

# `compare.sh OUT [--seeds 0,1,2] [overrides...]`: sets `out`, `seeds` and `overrides`.
parse_comparison() {
  if [ $# -lt 1 ] || [[ $1 == -* ]] || [[ $1 == *=* ]]; then
    echo "usage: $(basename "$0") OUT [--seeds 0,1,2] [overrides...]: OUT, the folder for the runs, comes first" >&2
    exit 2
  fi
  out=$1
  shift
  if [ "${1:-}" = --seeds ]; then
    IFS=, read -ra seeds <<< "${2:?--seeds needs a comma-separated list, e.g. --seeds 0,1,2}"
    shift 2
  fi
  overrides=("$@")
  if [ -n "${HFL_PARALLEL:-}" ] && ! [[ $HFL_PARALLEL =~ ^[1-9][0-9]*$ ]]; then
    echo "compare.sh: HFL_PARALLEL=$HFL_PARALLEL is not a number of runs >= 1" >&2
    exit 2
  fi
}

# CAFF's grids: OUT/costs/METHOD.json, each member's level costs for CONFIG (kept when there already).
#   member_costs METHOD CONFIG [overrides...]
member_costs() {
  local method=$1 config=$2
  shift 2
  mkdir -p "$out/costs"
  [ -f "$out/costs/$method.json" ] || python "$(dirname "${BASH_SOURCE[0]}")/../benchmarks/caff_member_costs.py" "$config" "$@" \
    --json "$out/costs/$method.json" | tee "$out/costs/$method.txt"
}

# CAFF's grids: run NAME from CONFIG on the family member `benchmarks/caff_member_costs.py --choose`
# picks from COSTS (LEVEL: smallest or largest) within MEMORY, UPLOAD and FLOPS; noted in OUT/not_run.txt
# when no member fits.
#   run_on_member NAME CONFIG COSTS LEVEL MEMORY UPLOAD FLOPS [overrides...]
run_on_member() {
  local name=$1 config=$2 costs=$3 level=$4 memory=$5 upload=$6 flops=$7 member
  shift 7
  member=$(python "$(dirname "${BASH_SOURCE[0]}")/../benchmarks/caff_member_costs.py" --choose "$costs" --level "$level" \
           --memory "$memory" --upload "$upload" --flops "$flops")
  if [ "$member" = none ]; then
    echo "$name: no member's $level level fits memory $memory, upload $upload, FLOPs $flops; not run" | tee -a "$out/not_run.txt"
    return
  fi
  read -ra member <<< "$member"  # model.name=... model.pretrained=FAMILY:l
  run_method "$name" "$config" "$@" "${member[@]}"
}

# CAFF's grids, best of the members: run NAME-l<depth> on every member whose LEVEL level fits, for a
# report that shows each (the paper reports some baselines' best of four members).
#   run_on_members NAME CONFIG COSTS LEVEL MEMORY UPLOAD FLOPS [overrides...]
run_on_members() {
  local name=$1 config=$2 costs=$3 level=$4 memory=$5 upload=$6 flops=$7 line
  shift 7
  local members=()
  mapfile -t members < <(python "$(dirname "${BASH_SOURCE[0]}")/../benchmarks/caff_member_costs.py" --choose "$costs" --all \
                         --level "$level" --memory "$memory" --upload "$upload" --flops "$flops")
  if [ "${members[0]}" = none ]; then
    echo "$name: no member's $level level fits memory $memory, upload $upload, FLOPs $flops; not run" | tee -a "$out/not_run.txt"
    return
  fi
  for line in "${members[@]}"; do
    local member=()
    read -ra member <<< "$line"
    run_method "$name-l${member[1]##*:}" "$config" "$@" "${member[@]}"
  done
}

# CAFF's grids: `methods=caff,fedhm` runs only those methods (the caller sets `methods` from the option and
# `known` to the script's methods); refuses a name the script does not run.
#   select_methods "caff,fedhm"; selected fedhm && ...
select_methods() {
  local name
  IFS=, read -ra methods <<< "$1"
  for name in "${methods[@]}"; do
    [[ " ${known[*]} " == *" $name "* ]] || { echo "compare.sh: methods=$name is not one of ${known[*]}" >&2; exit 2; }
  done
}
selected() {
  [[ " ${methods[*]} " == *" $1 "* ]]
}

write_report() {
  wait  # for the runs HFL_PARALLEL started
  hfl report "${runs[@]}" --out "$out/report"
}

run_method() {
  local name=$1 config=$2 seed dir
  shift 2
  for seed in "${seeds[@]}"; do
    dir="$out/$name"
    [ "${#seeds[@]}" -gt 1 ] && dir="$out/$name-seed$seed"
    if [ -f "$dir/summary.json" ]; then  # finished before: running the script again completes an interrupted comparison
      echo "$dir: done before, kept"
      runs+=("$dir")
      continue
    fi
    local run=(hfl run --resume "$dir" "$@")
    # One wandb group per comparison (a no-op unless logging.wandb=true); the caller's overrides come after
    [ -f "$dir/checkpoint.pt" ] || run=(hfl run "$config" "logging.wandb_group=$(basename "$out")" "$@" "seed=$seed" --out "$dir")
    if [ -n "${HFL_PARALLEL:-}" ]; then
      while [ "$(jobs -rp | wc -l)" -ge "$HFL_PARALLEL" ]; do wait -n || true; done  # a failed or cut run frees its place too
      mkdir -p "$(dirname "$dir")"
      ${HFL_RUN_LIMIT:+timeout "$HFL_RUN_LIMIT"} "${run[@]}" > "$dir.log" 2>&1 &
    else
      "${run[@]}"
    fi
    runs+=("$dir")
  done
}
