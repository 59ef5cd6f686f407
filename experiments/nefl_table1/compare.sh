#!/usr/bin/env bash
# The NeFL paper's Table 1 (non-IID column): every method into OUT/<method>, then `hfl report` of
# them into OUT/report. `--seeds 0,1,2` runs each method once per seed (OUT/<method>-seed<k>) and the
# report gives mean ± std. Arguments after that are overrides applied to every run:
#   experiments/nefl_table1/compare.sh runs/nefl                       # paper scale (GPU advised)
#   experiments/nefl_table1/compare.sh runs/nefl-cpu --seeds 0,1,2 model.name=preresnet20 fl.rounds=20 fl.local_epochs=2
# `fjord` is the FjORD row as NeFL's authors run it (NeFL-W with fixed step sizes);
# `fjord_ordered_dropout` is FjORD by its own paper, a row of its own.
# On ResNet-18/34/56/110 NeFL-D and NeFL-WD omit the blocks of the paper's Tables 10-14 (the default,
# method.omit=auto). PreResNet-20 has none: it omits the same leading blocks of every stage
# (method.omit=per_stage, as the paper's ResNet-56 NeFL-WD table), and DepthFL's exits move to
# blocks 5-8 (prefix shares 0.17-0.73).
set -euo pipefail
here=$(dirname "$0")
source "$here/../compare_lib.sh"
parse_comparison "$@"
depthfl=()
depth=()
for arg in "${overrides[@]}"; do
  case $arg in
    model.name=preresnet20) depthfl=("method.exit_blocks=[5,6,7,8]") depth=(method.omit=per_stage) ;;
  esac
done
for method in nefl_w nefl_d nefl_wd heterofl fjord fjord_ordered_dropout depthfl; do
  extra=()
  case $method in
    depthfl) extra=("${depthfl[@]}") ;;
    nefl_d | nefl_wd) extra=("${depth[@]}") ;;
  esac
  run_method "$method" "$here/$method.yaml" "${overrides[@]}" "${extra[@]}"
done
write_report
