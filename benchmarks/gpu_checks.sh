#!/usr/bin/env bash
# Every GPU check of hfl in one go, for a machine with CUDA (CI never runs it). In order:
#   1. the tests marked gpu (FeDepth's clients under fair and lack budgets measured within them with
#      cuDNN's workspace capped, in float32 and bf16; estimates within 5 % of
#      torch.cuda.max_memory_allocated in float32 and bf16), while CIFAR-10 is decoded once for the runs below,
#   2. with --table2 SECONDS: FeDepth's Table 2 cell at the paper's scale (experiments/fedepth_table2,
#      all seven methods at once, each cut after SECONDS) in the background, beside the memory-only steps:
#   3. the memory table under bf16 (estimate vs torch.cuda.max_memory_allocated),
#   4. what the allocator holds at the ViT's peak (the rows still above the estimate),
#   5. FeDepth's fair run at batch 128: every client's measured peak against its budget (benchmarks/gpu_budgets.py),
#   then, the GPU to themselves, the timings:
#   6. budgeted clients (cuDNN capped) against unbudgeted ones, and bf16 against float32 (gpu_budgets.py),
#   7. hfl's LocalBackend against a plain PyTorch loop, and a profile of hfl's side.
# Each step has a time limit, so one that hangs leaves the others their time; everything goes to
# OUT (a folder) and the console. Run from the repository root:
#
#   benchmarks/gpu_checks.sh OUT [--table2 SECONDS]
#
# CIFAR-10 is read from $HFL_DATA/cifar10_jpeg (the JPEG zip, see docs/data.md). With --table2 150 the
# whole script takes about 560 s, under the device tool's 10-minute limit per command; the timings come
# last, so a limit cuts the profile first.
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
# FeDepth's budget tests first, in a process of their own: hfl sets cuDNN's workspace cap before the
# process's first convolution, which a test of an unbudgeted run would otherwise make.
step tests_budgets 70 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/methods/test_fedepth.py
step tests 80 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/accounting/test_client_metrics.py tests/test_cuda_allocator.py \
    tests/test_client.py tests/test_precision.py
wait $decode || failed+=("decode")

if [ "$TABLE2" -gt 0 ]; then
    echo "== table2: 7 runs at once, each cut after ${TABLE2}s"
    HFL_PARALLEL=7 HFL_RUN_LIMIT=$TABLE2 experiments/fedepth_table2/compare.sh "$OUT/table2" backend.device=cuda backend.threads=1 \
        > "$OUT/table2.log" 2>&1 &
    table2=$!
fi
step memory_bf16 70 "$PY" benchmarks/memory_accuracy.py --device cuda --precision bf16-mixed --kinds whole --json "$OUT/memory_bf16.json"
step trace 40 "$PY" benchmarks/cuda_peak_trace.py --model vit --width 1 --batch 32
step budgets_fedepth 90 "$PY" benchmarks/gpu_budgets.py --only fedepth --json "$OUT/budgets_fedepth.json"
if [ "$TABLE2" -gt 0 ]; then
    timeout $((TABLE2 + 60)) tail --pid=$table2 -f /dev/null
    kill $table2 2>/dev/null
    tar czf "$OUT/table2.tgz" -C "$OUT" table2 table2.log 2>/dev/null && rm -rf "$OUT/table2" "$OUT/table2.log"
fi
step budgets_speed 170 "$PY" benchmarks/gpu_budgets.py --only speed --json "$OUT/budgets_speed.json"
step throughput 50 "$PY" benchmarks/throughput.py --device cuda --repeats 2 --rounds 10 --trainers fast
step profile 40 bash -c "$PY -m cProfile -o '$OUT/hfl.prof' benchmarks/throughput.py --device cuda --repeats 1 --rounds 5 --trainers fast \
    && $PY -c \"import pstats; s = pstats.Stats('$OUT/hfl.prof'); s.sort_stats('tottime').print_stats(30); s.sort_stats('cumtime').print_stats('hfl', 30)\""
rm -f "$OUT/hfl.prof"

echo "failed steps: ${failed[*]:-none}"
