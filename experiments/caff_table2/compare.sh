#!/usr/bin/env bash
# CAFF's Table 2 (Pfeiffer et al. 2024, ../shared/papers/004_*): heterogeneous constraints, half the
# clients low and half high, on Shakespeare with the lm_cpu family; CAFF, HetLoRA, FedHM, FedRolex
# (experiments/caff_table1/*.yaml) and HeteroFL, FjORD, DepthFL (here). CAFF picks its member (Eq. 3);
# HetLoRA and FedRolex run on the deepest member whose smallest level fits the low clients, HeteroFL,
# FjORD and DepthFL on the deepest member a high client can train whole, and FedHM on the deepest member
# a high client could train without SVD (its dense model; its clients still all train factors), as
# CAFF's appendix B picks them,
# both by `benchmarks/caff_member_costs.py` (tables in OUT/costs). Settings, against our family's
# measured costs as in experiments/caff_table1/compare.sh:
#   memory [60, 110] MiB    upload [0.5, 2] MiB    FLOPs [5, 20] GFLOPs per mini-batch (the paper's unit)
# `task=cifar10` runs it on CIFAR-10 classes 5-9 with the vit_cpu family (configs in cifar10/ and
# ../caff_table1/cifar10/), at the ViT amounts of experiments/caff_table1/compare.sh:
#   memory [125, 215] MiB    upload [2, 7] MiB    FLOPs [19.2, 51.2] GFLOPs per mini-batch
# Overrides go to every run; `kinds=memory` runs only those constraint kinds, `methods=caff,fedhm` only those methods.
#   experiments/caff_table2/compare.sh runs/caff2 fl.rounds=20
#   experiments/caff_table2/compare.sh runs/caff2_cifar10 task=cifar10 fl.rounds=20
set -euo pipefail
here=$(dirname "$0")
table1="$here/../caff_table1"
source "$here/../compare_lib.sh"
parse_comparison "$@"
kinds=(memory upload flops)
configs=$here
known=(caff hetlora fedhm fedrolex heterofl fjord depthfl)
methods=("${known[@]}")
common=()
for arg in "${overrides[@]}"; do
  case $arg in
    task=shakespeare) ;;
    task=cifar10) configs=$here/cifar10 table1=$table1/cifar10 ;;
    task=*) echo "compare.sh: task=${arg#task=} is not one of shakespeare, cifar10" >&2; exit 2 ;;
    kinds=*) IFS=, read -ra kinds <<< "${arg#kinds=}" ;;
    methods=*) select_methods "${arg#methods=}" ;;
    *) common+=("$arg") ;;
  esac
done
declare -A config=([hetlora]="$table1/hetlora.yaml" [fedhm]="$table1/fedhm.yaml" [fedrolex]="$table1/fedrolex.yaml"
                   [heterofl]="$configs/heterofl.yaml" [fjord]="$configs/fjord.yaml" [depthfl]="$configs/depthfl.yaml")
declare -A fits=([hetlora]=smallest [fedhm]=largest [fedrolex]=smallest [heterofl]=largest [fjord]=largest [depthfl]=largest)
for method in "${!config[@]}"; do
  selected "$method" || continue
  dense=()  # FedHM's costs with its dense level on top, so that `largest` is the model without SVD
  [ "$method" = fedhm ] && dense=("method.train_dense=true")
  member_costs "$method" "${config[$method]}" "${common[@]}" "${dense[@]}"
done
declare -A lows=([memory]=60MiB [upload]=0.5MiB [flops]=5e9) highs=([memory]=110MiB [upload]=2MiB [flops]=20e9)
[ "$configs" = "$here" ] || lows=([memory]=125MiB [upload]=2MiB [flops]=19.2e9) highs=([memory]=215MiB [upload]=7MiB [flops]=51.2e9)
free=1e15
for kind in "${kinds[@]}"; do
  declare -A lo=([memory]=$free [upload]=$free [flops]=$free) hi=([memory]=$free [upload]=$free [flops]=$free)
  lo[$kind]=${lows[$kind]}
  hi[$kind]=${highs[$kind]}
  budget=("budgets.memory=[${lo[memory]},${hi[memory]}]" "budgets.upload=[${lo[upload]},${hi[upload]}]" "budgets.flops=[${lo[flops]},${hi[flops]}]")
  selected caff && run_method "$kind-caff" "$table1/caff.yaml" "${common[@]}" "${budget[@]}"
  for method in hetlora fedhm fedrolex heterofl fjord depthfl; do
    selected "$method" || continue
    if [ "${fits[$method]}" = smallest ]; then side=("${lo[memory]}" "${lo[upload]}" "${lo[flops]}")
    else side=("${hi[memory]}" "${hi[upload]}" "${hi[flops]}"); fi
    run_on_member "$kind-$method" "${config[$method]}" "$out/costs/$method.json" "${fits[$method]}" "${side[@]}" "${common[@]}" "${budget[@]}"
  done
done
write_report
