#!/usr/bin/env bash
# One cell of the FeDepth paper's Table 2: every method into OUT/<method>, then `hfl report` of them
# into OUT/report. `--seeds 0,1,2` runs each method once per seed (OUT/<method>-seed<k>) and the report
# gives mean ± std. Arguments after that are overrides applied to every run (the column and the row):
#   experiments/fedepth_table2/compare.sh runs/t2/fair-a0.3                          # paper scale (GPU advised)
#   experiments/fedepth_table2/compare.sh runs/t2/fair-a1.0 data.alpha=1.0
#   experiments/fedepth_table2/compare.sh runs/t2/lack-b2 budgets.scenario=lack data.partition=pathological data.labels_per_client=2
#   experiments/fedepth_table2/compare.sh runs/t2/cpu fl.rounds=20 fl.local_epochs=1   # CPU scale
# FedAvg x min r follows the scenario's smallest ratio (1/6, or 1/8 under lack); under surplus the
# paper runs only FeDepth and m-FeDepth, so only they run.
set -euo pipefail
here=$(dirname "$0")
source "$here/../compare_lib.sh"
parse_comparison "$@"
scenario=fair
for arg in "${overrides[@]}"; do
  case $arg in budgets.scenario=*) scenario=${arg#budgets.scenario=} ;; esac
done
methods=(fedavg_x1 fedavg_min_r heterofl splitmix depthfl fedepth mfedepth)
[ "$scenario" = surplus ] && methods=(fedepth mfedepth)
for method in "${methods[@]}"; do
  extra=()
  [ "$method" = fedavg_min_r ] && [ "$scenario" = lack ] && extra=(model.width=0.125)
  run_method "$method" "$here/$method.yaml" "${overrides[@]}" "${extra[@]}"
done
write_report
