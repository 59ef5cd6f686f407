#!/usr/bin/env bash
# Which method reaches an accuracy first in simulated time on the same devices (docs/time.md)? Every
# run into OUT/<run> (OUT/<run>-seed<k> with `--seeds 0,1,2`), then `hfl report` of them into
# OUT/report: accuracy against simulated time, time to 0.8 and 0.9 (mean ± std over seeds).
# Arguments after the seeds are overrides applied to every run:
#   experiments/time_to_accuracy/compare.sh runs/tta --seeds 0,1,2                          # digits, CPU, a few minutes
#   TTA_DEADLINE_S=50 experiments/time_to_accuracy/compare.sh runs/tta_fmnist --seeds 0,1,2 data.name=fashion_mnist \
#     fl.clients=200 fl.fraction=0.05 fl.local_epochs=2 fl.time_targets=[0.7,0.8] fl.time_points=[700]
# TTA_DEADLINE_S is the deadline run's fl.deadline_s (default 1.5 s, for digits); an override cannot set it, as
# the other runs refuse a deadline. Scale it with a client-round's FLOPs: Fashion-MNIST's above are 34x digits'.
# The setting is the quickstart (digits, 20 clients, half per round, 3 local epochs, 20 rounds) on three
# device classes, which are the budget tiers (a third of the clients each; spread: log-normal, sigma 0.3):
#   slow: memory of training the CNN at width 1/4, 1e8 FLOP/s, 250 kB/s down, 100 kB/s up
#   mid:  width 1/2, 5e8 FLOP/s, 1 MB/s down, 500 kB/s up
#   fast: width 1, 2.5e9 FLOP/s, 4 MB/s down, 2 MB/s up
# A full-model client-round (about 4e8 FLOPs, 78 kB each way) takes about 5 s on a slow device, 0.3 s on a fast one.
# TTA_DEVICES=synthetic puts the clients on hfl's shipped trace instead (docs/time.md: three classes, 0.5 / 0.3 / 0.2 of
# the devices, at 1e9 / 4e9 / 1.6e10 FLOP/s, each online and offline over a day); the budget tiers still set each
# client's memory. To compare at equal simulated time rather than equal rounds, add fl.time_limit_s=T and an
# fl.rounds high enough for the fastest run (every run stops at its first round ending at or after T).
set -euo pipefail
here=$(dirname "$0")
source "$here/../compare_lib.sh"
parse_comparison "$@"
quickstart="$here/../quickstart.yaml"
case "${TTA_DEVICES:-tiers}" in
  tiers) devices=(devices.source=tiers devices.speed=[1e8,5e8,2.5e9] devices.down=[250kB,1MB,4MB] devices.up=[100kB,500kB,2MB] devices.spread=0.3) ;;
  synthetic) devices=(devices.source=trace devices.trace=synthetic) ;;
  *) echo "compare.sh: TTA_DEVICES=${TTA_DEVICES}: allowed: tiers (the default), synthetic" >&2; exit 2 ;;
esac
setting=(fl.time_targets=[0.8,0.9] budgets.scenario=tiers "budgets.memory=[width:1/4,width:1/2,width:1]" budgets.names=[slow,mid,fast] "${devices[@]}")
fedbuff=(fl.round_policy=async fl.async_concurrency=10 fl.async_buffer=5 fl.rounds=40)  # 40 steps of 5: the client work of 20 rounds of 10
run_method fedavg_sync "$quickstart" "${setting[@]}" method.name=fedavg "${overrides[@]}"
run_method fedavg_deadline "$quickstart" "${setting[@]}" method.name=fedavg fl.round_policy=deadline "fl.deadline_s=${TTA_DEADLINE_S:-1.5}" "${overrides[@]}"
run_method heterofl "$quickstart" "${setting[@]}" method.name=heterofl "${overrides[@]}"
run_method fedepth "$quickstart" "${setting[@]}" method.name=fedepth "${overrides[@]}"
run_method depthfl "$quickstart" "${setting[@]}" method.name=depthfl "${overrides[@]}"
run_method fedbuff_fedavg "$quickstart" "${setting[@]}" method.name=fedavg "${fedbuff[@]}" "${overrides[@]}"
run_method fedbuff_heterofl "$quickstart" "${setting[@]}" method.name=heterofl "${fedbuff[@]}" "${overrides[@]}"
write_report
