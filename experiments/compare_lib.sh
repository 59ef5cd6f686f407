# Sourced by the comparison scripts (experiments/*/compare.sh): their arguments, seeds, one run per
# method and seed, and the report.
#   source compare_lib.sh; parse_comparison "$@"   # sets out, seeds, overrides
#   run_method NAME CONFIG [overrides...]           # into OUT/NAME, or OUT/NAME-seed<k> with several seeds;
#                                                   # a finished run is kept, an interrupted one resumed
#   write_report                                    # OUT/report; several seeds: mean ± std per method
seeds=(0)
runs=()
overrides=()

# `compare.sh OUT [--seeds 0,1,2] [overrides...]`: sets `out`, `seeds` and `overrides`.
parse_comparison() {
  out=${1:?usage: compare.sh OUT [--seeds 0,1,2] [overrides...]}
  shift
  if [ "${1:-}" = --seeds ]; then
    IFS=, read -ra seeds <<< "${2:?--seeds needs a comma-separated list, e.g. --seeds 0,1,2}"
    shift 2
  fi
  overrides=("$@")
}

write_report() {
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
    elif [ -f "$dir/checkpoint.pt" ]; then
      hfl run --resume "$dir" "$@"
    else
      hfl run "$config" "$@" "seed=$seed" --out "$dir"
    fi
    runs+=("$dir")
  done
}
