#!/usr/bin/env bash
# FedMef against FedTiny on one GPU, 3 seeds each, all six runs at once, for longer than the CPU
# allows (issue 35, part 4; issue 32's question whether FedMef's norm-free model catches up with more
# rounds). The setting is the CPU one of benchmarks/RESULTS.md (ResNet-18 at width 1/4, CIFAR-10 JPEG,
# 100 Dirichlet(0.5) clients, 10 per round, one local epoch, batch 64, lr 0.1 x 0.95 per round) with
# 60 rounds instead of 20 and the mask schedule scaled the same way (every 4 rounds up to round 36,
# the paper's R_stop = 0.6 R). Each run stops after SECONDS at the latest; its metrics.jsonl holds
# every round it reached (evaluated every 5), so a cut run still compares round for round.
#
#   benchmarks/gpu_fedmef_fidelity.sh OUT [SECONDS]     # then: hfl report OUT/*
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_fedmef_fidelity.sh OUT [SECONDS]}
LIMIT=${2:-480}
here=$(dirname "$0")
mkdir -p "$OUT"
for method in fedmef fedtiny; do
  for seed in 0 1 2; do
    timeout "$LIMIT" hfl run "$here/../experiments/fedmef_table1/$method.yaml" model.width=0.25 fl.rounds=60 \
      fl.local_epochs=1 fl.eval_every=5 method.adjust_every=4 method.stop_round=36 backend.device=cuda \
      backend.threads=1 "seed=$seed" --out "$OUT/$method-seed$seed" > "$OUT/$method-seed$seed.log" 2>&1 &
  done
done
wait
