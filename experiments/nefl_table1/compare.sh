#!/usr/bin/env bash
# The NeFL paper's Table 1 (non-IID column): every method into OUT/<method>, then `hfl report` of
# them into OUT/report. Arguments after OUT are overrides applied to every run:
#   experiments/nefl_table1/compare.sh runs/nefl                       # paper scale (GPU advised)
#   experiments/nefl_table1/compare.sh runs/nefl-cpu model.name=preresnet20 fl.rounds=20 fl.local_epochs=2
# DepthFL's exits are per model: with preresnet20 they move to blocks 5-8 (prefix shares 0.17-0.73).
set -euo pipefail
out=${1:?usage: compare.sh OUT [overrides...]}
shift
here=$(dirname "$0")
depthfl=()
for arg in "$@"; do
  case $arg in model.name=preresnet20) depthfl=("method.exit_blocks=[5,6,7,8]") ;; esac
done
runs=()
for method in nefl_w nefl_d nefl_wd heterofl fjord depthfl; do
  extra=()
  [ "$method" = depthfl ] && extra=("${depthfl[@]}")
  hfl run "$here/$method.yaml" "$@" "${extra[@]}" --out "$out/$method"
  runs+=("$out/$method")
done
hfl report "${runs[@]}" --out "$out/report"
