#!/usr/bin/env bash
# ScaleFL's comparison at equal training MEMORY (a variant; the paper compares at equal parameters:
# experiments/scalefl_cifar10/compare.sh, which this runs on the configs here): every method into
# OUT/<method>, then `hfl report` of them into OUT/report. `--seeds 0,1,2` runs each method once per
# seed (OUT/<method>-seed<k>) and the report gives mean ± std. Arguments after that are overrides:
#   experiments/scalefl_cifar10_equal_memory/compare.sh runs/scalefl                      # ScaleFL's scale (GPU advised)
#   experiments/scalefl_cifar10_equal_memory/compare.sh runs/scalefl data.alpha=100       # the near-IID column
set -euo pipefail
here=$(dirname "$0")
SCALEFL_CONFIGS=$here exec "$here/../scalefl_cifar10/compare.sh" "$@"
