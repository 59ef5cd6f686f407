#!/usr/bin/env bash
# FedMef's Table 1 (ResNet-18, CIFAR-10): every method into OUT/<method>, then `hfl report` of them into
# OUT/report. `--seeds 0,1,2` runs each method once per seed (OUT/<method>-seed<k>) and the report gives
# mean ± std. Arguments after that are overrides applied to every run; `method.sparsity=S` goes to the
# pruning methods only (FedAvg stays dense), `method.adjust_every=N` and `method.stop_round=N` to the
# methods that adjust masks (FedDST, FedTiny, FedMef):
#   experiments/fedmef_table1/compare.sh runs/fedmef-s0.9                           # paper scale (GPU advised)
#   experiments/fedmef_table1/compare.sh runs/fedmef-s0.8 method.sparsity=0.8
#   experiments/fedmef_table1/compare.sh runs/fedmef-cpu --seeds 0,1,2 fl.rounds=20 fl.local_epochs=1
set -euo pipefail
here=$(dirname "$0")
source "$here/../compare_lib.sh"
parse_comparison "$@"
common=()
sparsity=()
schedule=()
for arg in "${overrides[@]}"; do
  case $arg in
    method.sparsity=*) sparsity=("$arg") ;;
    method.adjust_every=* | method.stop_round=*) schedule+=("$arg") ;;
    *) common+=("$arg") ;;
  esac
done
for method in fedavg flpqsu feddst fedtiny fedmef; do
  extra=()
  [ "$method" != fedavg ] && extra+=("${sparsity[@]}")
  [ "$method" != fedavg ] && [ "$method" != flpqsu ] && extra+=("${schedule[@]}")
  run_method "$method" "$here/$method.yaml" "${common[@]}" "${extra[@]}"
done
write_report
