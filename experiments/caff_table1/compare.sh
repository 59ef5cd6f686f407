#!/usr/bin/env bash
# CAFF's Table 1 (Pfeiffer et al. 2024, ../shared/papers/004_*): homogeneous memory, upload and FLOPs
# constraints, three levels each, on Shakespeare with the lm_cpu family (`hfl pretrain
# experiments/pretrain/lm_cpu.yaml`). CAFF picks its member (Eq. 3); each baseline (HetLoRA, FedHM,
# FedRolex) runs on the deepest member whose smallest level fits every client
# (`benchmarks/caff_member_costs.py`, whose tables land in OUT/costs). The paper's MB / GFLOPs belong to
# its 8192-token vocabulary and 256-token context; ours are set against our family's measured costs
# (`hfl budget experiments/caff_table1/caff.yaml` prints CAFF's (l, t) table; batch 32):
#   memory  60 / 80 / 110 MiB  ~ CAFF's F_12^3 / F_12^4 / F_12^6 (16 MiB per trained block); HetLoRA needs
#                                56 MiB at l = 3 (rank 3) and 103 at l = 6, FedHM 51 and 97
#   upload  0.5 / 1 / 2 MiB    ~ CAFF's t = 1 / 2 / 4 (a block is 0.43 MiB)
#   FLOPs   5 / 10 / 20 GFLOPs per mini-batch of 32, the paper's unit (appendix A; the configs set
#           budgets.flops_per=batch; F_3^1 costs 3.4, F_6^1 5.3, F_12^1 9.2, F_12^12 23.8 per batch). At 10
#           and 20 Eq. 3 picks l = 9 and l = 12, where a client with a full batch trains 3 and 9 blocks
#           (`hfl budget experiments/caff_table1/caff.yaml "budgets.flops=[10e9]"` prints the choice). Before 2026-11-26 the grid bounded a
#           client-round at 200 / 400 / 800 GFLOPs, which let the client with the most text (691
#           windows x 2 epochs at seed 0) decide which members were feasible.
# `task=cifar10` runs the grid on CIFAR-10 classes 5-9 with the vit_cpu family instead (`hfl pretrain
# experiments/pretrain/vit_cpu.yaml`; configs in cifar10/), against that family's costs (a ViT block
# trains in 30 MiB at batch 32 and uploads 1.7 MiB; CAFF's t = 3 / 4 / 6 of l = 12 and t = 1 / 2 / 4):
#   memory  125 / 155 / 215 MiB    upload  2 / 3.5 / 7 MiB
#   FLOPs   19.2 / 32 / 51.2 GFLOPs per mini-batch (every client holds 250 images, one pass per round: the
#           same bounds as the 150 / 250 / 400 GFLOPs per client-round of before; F_3^3 costs 135 per
#           round, F_12^1 209, F_12^12 538)
# Overrides go to every run; `kinds=memory,upload` runs only those constraint kinds (two shells can
# split the grid), `levels=1,3` only those levels. `random_init=yes` adds, per column, CAFF on the same
# architecture with freshly initialised blocks (`model.pretrained=''`, into KIND-caff_random): the
# ablation the paper implies, what the frozen blocks owe to pretraining. `methods=caff,fedhm` runs only those
# methods (caff_random comes with caff). `members=all` runs each baseline on every member
# whose smallest level fits (into KIND-METHOD-l<depth>), for the best of four members the paper
# reports for some columns (Figure 4: "we evaluate all NN architectures ... and present the best").
#   experiments/caff_table1/compare.sh runs/caff1 fl.rounds=20
#   experiments/caff_table1/compare.sh runs/caff1_cifar10 task=cifar10 fl.rounds=20
set -euo pipefail
here=$(dirname "$0")
source "$here/../compare_lib.sh"
parse_comparison "$@"
kinds=(memory upload flops)
levels=(1 2 3)
configs=$here
choose=run_on_member
random_init=no
known=(caff hetlora fedhm fedrolex)
methods=("${known[@]}")
common=()
for arg in "${overrides[@]}"; do
  case $arg in
    task=shakespeare) ;;
    task=cifar10) configs=$here/cifar10 ;;
    task=*) echo "compare.sh: task=${arg#task=} is not one of shakespeare, cifar10" >&2; exit 2 ;;
    kinds=*) IFS=, read -ra kinds <<< "${arg#kinds=}" ;;
    levels=*) IFS=, read -ra levels <<< "${arg#levels=}" ;;
    members=deepest) choose=run_on_member ;;
    members=all) choose=run_on_members ;;
    members=*) echo "compare.sh: members=${arg#members=} is not one of deepest, all" >&2; exit 2 ;;
    random_init=yes) random_init=yes ;;
    random_init=no) random_init=no ;;
    random_init=*) echo "compare.sh: random_init=${arg#random_init=} is not one of yes, no" >&2; exit 2 ;;
    methods=*) select_methods "${arg#methods=}" ;;
    *) common+=("$arg") ;;
  esac
done
baselines=(hetlora fedhm fedrolex)
for method in "${baselines[@]}"; do
  selected "$method" || continue
  member_costs "$method" "$configs/$method.yaml" "${common[@]}"
done
declare -A amounts=([memory]="60MiB 80MiB 110MiB" [upload]="0.5MiB 1MiB 2MiB" [flops]="5e9 10e9 20e9")
[ "$configs" = "$here" ] || amounts=([memory]="125MiB 155MiB 215MiB" [upload]="2MiB 3.5MiB 7MiB" [flops]="19.2e9 32e9 51.2e9")
free=1e15
for kind in "${kinds[@]}"; do
  read -ra values <<< "${amounts[$kind]}"
  for level in "${levels[@]}"; do
    value=${values[$((level - 1))]}
    memory=$free upload=$free flops=$free
    declare "$kind=$value"
    budget=("budgets.memory=[$memory]" "budgets.upload=[$upload]" "budgets.flops=[$flops]")
    if selected caff; then
      run_method "$kind$level-caff" "$configs/caff.yaml" "${common[@]}" "${budget[@]}"
      [ "$random_init" = no ] || run_method "$kind$level-caff_random" "$configs/caff.yaml" "${common[@]}" "${budget[@]}" "model.pretrained=''"
    fi
    for method in "${baselines[@]}"; do
      selected "$method" || continue
      $choose "$kind$level-$method" "$configs/$method.yaml" "$out/costs/$method.json" smallest "$memory" "$upload" "$flops" \
        "${common[@]}" "${budget[@]}"
    done
  done
done
write_report
