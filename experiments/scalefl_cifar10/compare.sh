#!/usr/bin/env bash
# ScaleFL's comparison at equal parameters (the paper's protocol): every method into OUT/<method>, then
# `hfl report` of them into OUT/report. `--seeds 0,1,2` runs each method once per seed (OUT/<method>-seed<k>)
# and the report gives mean ± std. Arguments after that are overrides applied to every run:
#   experiments/scalefl_cifar10/compare.sh runs/scalefl                      # ScaleFL's scale (GPU advised)
#   experiments/scalefl_cifar10/compare.sh runs/scalefl data.alpha=100       # the near-IID column
#   experiments/scalefl_cifar10/compare.sh runs/scalefl_digits --seeds 0,1,2 data.name=digits model.name=preresnet20 \
#       fl.clients=20 fl.fraction=0.5 fl.rounds=10 fl.batch_size=16 fl.local_epochs=1   # reduced, CPU
# experiments/scalefl_cifar10_equal_memory/compare.sh compares the same methods at equal training memory:
# it runs this script on its own configs (SCALEFL_CONFIGS).
set -euo pipefail
here=$(dirname "$0")
source "$here/../compare_lib.sh"
parse_comparison "$@"
configs=${SCALEFL_CONFIGS:-$here}
for method in fedavg decoupled heterofl fedrolex fjord depthfl scalefl feddf; do
  run_method "$method" "$configs/$method.yaml" "${overrides[@]}"
done
write_report
