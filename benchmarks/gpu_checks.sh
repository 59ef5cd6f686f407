#!/usr/bin/env bash
# Every GPU check of hfl in one go, for a machine with CUDA (CI never runs it):
#   1. the memory-accounting table (estimate vs torch.cuda.max_memory_allocated), with cuDNN off as
#      hfl trains budgeted clients, and with it on for the workspace it adds; what the allocator holds
#      at the ViT's peak (the rows still above the estimate),
#   2. the tests marked gpu,
#   3. hfl's LocalBackend vs a plain PyTorch loop on the GPU,
#   4. clients per second at FeDepth's client setting, and several clients at once on one GPU,
#   5. with --ray, one `hfl run` whose first client's memory budget is too small for its training.
# Each step has a time limit, so one that hangs leaves the others their time; everything goes to
# OUT (a folder) and the console. Run from the repository root:
#
#   benchmarks/gpu_checks.sh OUT [--ray]        # --ray: also Ray actors sharing the GPU
#
# CIFAR-10 is read from $HFL_DATA/cifar10_jpeg (see the README; 10,000 training images suffice) and
# Shakespeare from $HFL_DATA/shakespeare. Steps run in order of value and their limits add up to
# 590 s, under the device tool's 10-minute limit per command (the memory table alone took 134 s on an
# H100 with the GPU to itself; 13 times that beside 21 training runs: run nothing else beside it).
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_checks.sh OUT [--ray]}
RAY=${2:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || failed+=("$name ($rc)")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

step memory 150 "$PY" benchmarks/memory_accuracy.py --device cuda --json "$OUT/memory.json"
step memory_cudnn 40 "$PY" benchmarks/memory_accuracy.py --device cuda --cudnn on --kinds whole,fedepth --json "$OUT/memory_cudnn.json"
step trace 40 "$PY" benchmarks/cuda_peak_trace.py --model vit --width 1 --batch 32  # what the ViT's unexplained MiB are
step tests 90 "$PY" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors  # modules that import Ray fail to collect where it is missing
step throughput 60 "$PY" benchmarks/throughput.py --device cuda --repeats 2 --rounds 10  # both drivers: fast and lightning
step clients 160 "$PY" benchmarks/gpu_clients.py --data cifar10_jpeg --device cuda --rounds 4 --json "$OUT/clients.json" $RAY
[ -z "$RAY" ] || step budget_run 50 "$PY" benchmarks/gpu_budget_run.py

echo "failed steps: ${failed[*]:-none}"
