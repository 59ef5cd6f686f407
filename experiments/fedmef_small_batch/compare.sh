#!/usr/bin/env bash
# FedMef's Figure 5 at small batch sizes (Huang et al., CVPR 2024; ../shared/papers/001_*): every method at
# every batch size into OUT/<method>-b<batch> (OUT/<method>-b<batch>-seed<k> with `--seeds 0,1,2`), then
# `hfl report` of them into OUT/report (mean ± std over seeds).
#   left:  FedAvg, FL-PQSU, FedDST, FedTiny, FedMef at each of `batches=` (default 1,2,8)
#   right: at each of `ablation_batches=` (default 1,2), FedMef without BaE (fedmef_no_bae: method.bae=false,
#          neither the surrogate term nor the budgeted rate μ_t), without SAP as the
#          paper ablates it (fedmef_no_sap: activation pruning without NSConv, on batch norm, DropIT's
#          approach: method.nsconv=false model.norm=bn) and the norm-free model alone (fedmef_nsconv_only:
#          NSConv kept, neither BaE nor activation pruning: method.bae=false method.activation_sparsity=0)
# `methods=fedavg,fedtiny,fedmef` runs only those of the runs above (ablations by their names). Other arguments
# after the seeds are overrides applied to every run; `method.*` ones go to the pruning methods only (FedAvg has
# none of their fields):
#   experiments/fedmef_small_batch/compare.sh runs/fsb --seeds 0,1,2                 # digits, CPU scale
#   experiments/fedmef_small_batch/compare.sh runs/fsb_b1 --seeds 0,1,2 batches=1 ablation_batches=1
#   experiments/fedmef_small_batch/compare.sh runs/fsb_cifar --seeds 0,1,2 data.name=cifar10_jpeg \
#     model.name=resnet18 model.width=0.125 fl.clients=100 fl.fraction=0.1 fl.rounds=20 fl.lr=0.01   # the paper's data (GPU advised)
set -euo pipefail
here=$(dirname "$0")
source "$here/../compare_lib.sh"
parse_comparison "$@"
known=(fedavg flpqsu feddst fedtiny fedmef fedmef_no_bae fedmef_no_sap fedmef_nsconv_only)
methods=("${known[@]}")
batches=(1 2 8)
ablation_batches=(1 2)
common=()
pruning=()
for arg in "${overrides[@]}"; do
  case $arg in
    batches=*) IFS=, read -ra batches <<< "${arg#batches=}" ;;
    ablation_batches=*) IFS=, read -ra ablation_batches <<< "${arg#ablation_batches=}" ;;
    methods=*) select_methods "${arg#methods=}" ;;
    fl.batch_size=*) echo "compare.sh: the batch sizes come from batches=1,2,8, not $arg" >&2; exit 2 ;;
    method.*) pruning+=("$arg") ;;
    *) common+=("$arg") ;;
  esac
done
for batch in "${batches[@]}" "${ablation_batches[@]}"; do
  [[ $batch =~ ^[1-9][0-9]*$ ]] || { echo "compare.sh: batch size $batch is not an integer >= 1" >&2; exit 2; }
done
declare -A ablation=(
  [fedmef_no_bae]="method.bae=false"
  [fedmef_no_sap]="method.nsconv=false model.norm=bn"
  [fedmef_nsconv_only]="method.bae=false method.activation_sparsity=0"
)
for batch in "${batches[@]}"; do
  for method in fedavg flpqsu feddst fedtiny fedmef; do
    selected "$method" || continue
    extra=()
    [ "$method" != fedavg ] && extra+=("${pruning[@]}")
    run_method "$method-b$batch" "$here/$method.yaml" fl.batch_size="$batch" "${common[@]}" "${extra[@]}"
  done
done
for batch in "${ablation_batches[@]}"; do
  for variant in fedmef_no_bae fedmef_no_sap fedmef_nsconv_only; do
    selected "$variant" || continue
    read -ra settings <<< "${ablation[$variant]}"
    run_method "$variant-b$batch" "$here/fedmef.yaml" fl.batch_size="$batch" "${settings[@]}" "${common[@]}" "${pruning[@]}"
  done
done
write_report
