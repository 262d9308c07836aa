#!/usr/bin/env bash
# The GPU check, in one call on a machine with an NVIDIA GPU and no network (its python3
# already holds torch with CUDA, transformers, peft, nanobind, scikit-build-core, cmake, ninja,
# pytest; accelerate for the Trainer tests): builds RoundPipe with those packages, runs
# tests/test_gpu.py and tests/test_trainer_gpu.py (RoundPipeTrainer on CUDA), then the pipeline
# benchmark on a ~1.4B-parameter bf16 model against plain PyTorch on the same GPU (tokens/s,
# waits, upload GB/s against a pinned copy's peak, reserved memory, bytes moved over their
# floor), then the generation benchmark (tokens/s against plain transformers generate on the
# same GPU, batch 1 and 64, weight bytes per generated token), then LoRA on an NF4 frozen base
# (tokens/s and upload bytes against a bf16 base; one layer's dequantization time against its
# upload time, bitsandbytes' dequantize_4bit alongside when installed), and prints the tables.
# Budget: under 10 minutes on one H200.
#   bash scripts/gpu_check.sh              # PYTHON=... to use another interpreter
# Results also go to $OUT (or /tmp/gpu_check): test_gpu.txt, pipeline.json, generate.json,
# qlora.json, table.txt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

echo "== environment"
$PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '|',
torch.cuda.get_device_name(0), '|', torch.cuda.device_count(), 'GPU(s)')"
nproc

echo "== build (no network: the packages already installed)"
start=$SECONDS
$PY -m pip install -q --no-build-isolation --no-deps --no-index . >"$out/build.txt" 2>&1 ||
  { tail -30 "$out/build.txt"; exit 1; }
echo "built in $((SECONDS - start)) s"

echo "== tests/test_gpu.py"
start=$SECONDS
set +e
(cd /tmp && $PY -m pytest -q -p no:cacheprovider "$OLDPWD/tests/test_gpu.py" -x --timeout 240 -rs) \
  2>&1 | tee "$out/test_gpu.txt"
tests_rc=${PIPESTATUS[0]}
set -e
echo "tests: exit $tests_rc in $((SECONDS - start)) s"

echo "== tests/test_trainer_gpu.py: RoundPipeTrainer on CUDA against plain Trainer on the GPU"
start=$SECONDS
set +e
(cd /tmp && $PY -m pytest -q -s -p no:cacheprovider "$OLDPWD/tests/test_trainer_gpu.py" -x \
  --timeout 240 -rs) 2>&1 | tee "$out/test_trainer_gpu.txt"
trainer_rc=${PIPESTATUS[0]}
set -e
echo "trainer tests: exit $trainer_rc in $((SECONDS - start)) s (skipped without accelerate)"
[ "$trainer_rc" -eq 0 ] || [ "$tests_rc" -ne 0 ] || tests_rc=$trainer_rc

echo "== pipeline benchmark: bf16, 16 layers x 2560 (about 1.4B parameters), seq 1024, batch 8"
start=$SECONDS
(cd /tmp && $PY -m roundpipe.bench pipeline --devices cuda:0 --dtype bfloat16 --layers 16 \
  --hidden 2560 --heads 20 --vocab 32000 --seq 1024 --batch 8 --iters 2 --repeats 5 \
  --json "$out/pipeline.json") | tee "$out/table.txt"
echo "benchmark in $((SECONDS - start)) s"

echo "== generation benchmark: bf16 Llama, 16 layers x 2048, prompt 128, 32 new tokens, batch 1 and 64"
start=$SECONDS
(cd /tmp && $PY -m roundpipe.bench generate --device cuda:0 --dtype bfloat16 --layers 16 \
  --hidden 2048 --heads 16 --kv-heads 8 --vocab 32000 --prompt 128 --new-tokens 32 \
  --batch 1 64 --repeats 5 --json "$out/generate.json") | tee -a "$out/table.txt"
echo "generation benchmark in $((SECONDS - start)) s"

echo "== LoRA on an NF4 base on CUDA: tokens/s and uploads against a bf16 base (Llama 4 x 2048),"
echo "   one 4096 x 11008 layer's dequantization against its upload (bitsandbytes' alongside)"
start=$SECONDS
(cd /tmp && $PY -m roundpipe.bench.qlora --device cuda:0 --hidden 2048 --layers 4 --seq 512 \
  --repeats 5 --json "$out/qlora.json") | tee -a "$out/table.txt"
echo "NF4 run in $((SECONDS - start)) s"
exit "$tests_rc"
