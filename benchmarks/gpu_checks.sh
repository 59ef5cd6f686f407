#!/usr/bin/env bash
# The GPU checks of one lease in one go, for a machine with CUDA (CI never runs it). In order of value:
#   1. the tests marked gpu: FeDepth's clients under fair and lack budgets, each under the allocator's
#      cap of its budget with cuDNN (float32 and bf16): none fails, and the measured peaks against the
#      budgets (two float32 cases are expected failures: the fifth lease measured 1.174x); the estimates within 5 % of torch.cuda.max_memory_allocated; batched clients equal to
#      one-by-one training in float64, each reporting its share of the group's peak; augmenting a batch
#      without synchronising with the GPU;
#   2. FeDepth's fair run at batch 128 under each rule for the cap: failed clients and measured peaks
#      against budgets (benchmarks/gpu_memory_cap.py);
#   3. budgeted against unbudgeted clients per second, and bf16 against float32 (gpu_budgets.py --only speed);
#   4. clients per second with 8 and 16 clients trained together: FedAvg, FedProx, DepthFL (its distillation
#      batched since the sixth session), and HeteroFL, FeDepth and SplitMix under fair budgets
#      (benchmarks/gpu_clients.py);
#   5. hfl's LocalBackend against a plain PyTorch loop;
#   6. with --table2 SECONDS: FeDepth's Table 2 cell at the paper's scale, all seven methods at once,
#      each cut after SECONDS, in the background of steps 2-5 (their timings are then shared: use it
#      only where the rates are what is wanted).
# Each step has a time limit, so one that hangs leaves the others their time; everything goes to OUT
# (a folder) and the console. Run from the repository root; where `pip install -e .` cannot build
# (no network), `PYTHONPATH=.` serves:
#
#   PYTHONPATH=. benchmarks/gpu_checks.sh OUT [--table2 SECONDS]
#
# CIFAR-10 is read from $HFL_DATA/cifar10_jpeg (the JPEG zip, see docs/data.md). The limits add up to
# about 570 s, under the device tool's 10-minute limit per command; the device tool brings back at
# most 8 files, so pack OUT into one archive after the script.
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_checks.sh OUT [--table2 SECONDS]}
TABLE2=0
[ "${2:-}" = --table2 ] && TABLE2=${3:?--table2 needs SECONDS}
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
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name())"
lscpu | grep -E 'Model name|Vendor ID' || true

# The runs below read CIFAR-10's decoded cache; decoding it once here keeps them from racing to write it.
timeout 120 "$PY" -c "from hfl.data import load_dataset; from hfl.data.cache import default_cache_dir, default_data_root; \
load_dataset('cifar10_jpeg', default_data_root(), default_cache_dir())" > "$OUT/decode.log" 2>&1 &
decode=$!
step tests_budgets 75 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/methods/test_fedepth.py
step tests 80 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/accounting/test_client_metrics.py tests/test_cuda_allocator.py \
    tests/test_client.py tests/test_precision.py tests/data/test_transforms.py
wait $decode || failed+=("decode")

if [ "$TABLE2" -gt 0 ]; then
    echo "== table2: 7 runs at once, each cut after ${TABLE2}s"
    HFL_PARALLEL=7 HFL_RUN_LIMIT=$TABLE2 experiments/fedepth_table2/compare.sh "$OUT/table2" backend.device=cuda backend.threads=1 \
        > "$OUT/table2.log" 2>&1 &
fi
step memory_cap 110 "$PY" benchmarks/gpu_memory_cap.py --rules reserved,pool --json "$OUT/memory_cap.json"
step budgets_speed 100 "$PY" benchmarks/gpu_budgets.py --only speed --json "$OUT/budgets_speed.json"
step clients 160 "$PY" benchmarks/gpu_clients.py --data cifar10_jpeg --device cuda --rounds 4 --skip-setting \
    --methods fedavg,fedprox,depthfl,heterofl:fair,fedepth:fair,splitmix:fair --sizes 8,16 --json "$OUT/clients.json"
step throughput 45 "$PY" benchmarks/throughput.py --device cuda --repeats 3 --rounds 10 --trainers fast
wait

echo "failed steps: ${failed[*]:-none}"
