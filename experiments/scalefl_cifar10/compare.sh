#!/usr/bin/env bash
# Run every method of the ScaleFL comparison into OUT/<method>, then `hfl report` them into OUT/report.
# Arguments after OUT are overrides applied to every run:
#   experiments/scalefl_cifar10/compare.sh runs/scalefl                      # ScaleFL's scale (GPU advised)
#   experiments/scalefl_cifar10/compare.sh runs/scalefl data.alpha=100       # the near-IID column
#   experiments/scalefl_cifar10/compare.sh runs/scalefl_digits data.name=digits model.name=preresnet20 \
#       fl.clients=20 fl.fraction=0.5 fl.rounds=10 fl.batch_size=16 fl.local_epochs=1   # reduced, ~5 min on a CPU
set -euo pipefail
out=${1:?usage: compare.sh OUT [overrides...]}
shift
here=$(dirname "$0")
for method in fedavg decoupled heterofl fedrolex fjord depthfl scalefl feddf; do
  hfl run "$here/$method.yaml" "$@" --out "$out/$method"
done
hfl report "$out"/fedavg "$out"/decoupled "$out"/heterofl "$out"/fedrolex "$out"/fjord "$out"/depthfl "$out"/scalefl "$out"/feddf --out "$out/report"
