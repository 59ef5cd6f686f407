#!/usr/bin/env bash
# FedAvg on Shakespeare from the pretrained family member and from random weights, then `hfl report`
# into OUT/report. `model.pretrained=...` goes to the pretrained run only; other overrides to both.
#   experiments/lm_pretrained_vs_random/compare.sh runs/lm --seeds 0,1,2
#   experiments/lm_pretrained_vs_random/compare.sh runs/lm6 model.name=gpt_l6 model.pretrained=lm_cpu:6
set -euo pipefail
here=$(dirname "$0")
source "$here/../compare_lib.sh"
parse_comparison "$@"
common=()
pretrained=()
for arg in "${overrides[@]}"; do
  case $arg in
    model.pretrained=*) pretrained=("$arg") ;;
    *) common+=("$arg") ;;
  esac
done
run_method pretrained "$here/pretrained.yaml" "${common[@]}" "${pretrained[@]}"
run_method random "$here/random.yaml" "${common[@]}"
write_report
