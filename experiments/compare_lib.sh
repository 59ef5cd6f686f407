# Sourced by the comparison scripts (experiments/*/compare.sh): seeds and one run per method and seed.
#   out=OUT; source compare_lib.sh; take_seeds "$@" && shift "$SEED_ARGS"
#   run_method NAME CONFIG [overrides...]      # into OUT/NAME, or OUT/NAME-seed<k> with several seeds
#   hfl report "${runs[@]}" --out "$out/report"  # several seeds: mean ± std per method
seeds=(0)
runs=()
SEED_ARGS=0

# `--seeds 0,1,2` as the first argument after OUT: sets `seeds` and SEED_ARGS (how many arguments to shift).
take_seeds() {
  if [ "${1:-}" = --seeds ]; then
    IFS=, read -ra seeds <<< "${2:?--seeds needs a comma-separated list, e.g. --seeds 0,1,2}"
    SEED_ARGS=2
  fi
}

run_method() {
  local name=$1 config=$2 seed dir
  shift 2
  for seed in "${seeds[@]}"; do
    dir="$out/$name"
    [ "${#seeds[@]}" -gt 1 ] && dir="$out/$name-seed$seed"
    hfl run "$config" "$@" "seed=$seed" --out "$dir"
    runs+=("$dir")
  done
}
