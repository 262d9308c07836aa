#!/usr/bin/env bash
# The GPU check, in one call on a machine with an NVIDIA GPU and no network (its python3 already
# holds torch with CUDA, nanobind, scikit-build-core, cmake, ninja, pytest, accelerate and a
# transformers/peft; wheels of newer ones in .whl/ are installed to /tmp/site first, see
# /work/.library/device/README.md). Sections, in this order (default: all but plans):
#
#   tests     tests/test_gpu.py, test_trainer_gpu.py, test_fused_dequant.py (the compiled
#             dequantization on CUDA), test_generate_prefetch.py
#   capped    the 1.82B Llama under a 3 GB cap: sync, async, exact; first loss against plain HF
#   bench8k   bench pipeline, 1.82B Llama, 8 x 1024 tokens per step: sync, async, exact against
#             plain HF with gradient checkpointing and FSDP2 with CPU offload; each mode's bound
#   bench64k  the same at 64 x 1024 tokens per step (fine-tuning's usual 64k)
#   profile   one exact-mode call of the 1.82B under torch.profiler and cProfile, and the CUDA
#             memory history of two calls: $OUT/profile.tar
#   generate  generation through the pipeline against transformers' generate and its bound,
#             a bf16 and an NF4 base
#   qlora     LoRA on an NF4 base against a bf16 base, upload-bound (1 x 512) and 4 x 512
#   plans     (optional) the automatic stage plan against fixed ones at 4k and 64k tokens
#
#   bash scripts/gpu_check.sh                      # all but plans (budget: under 8 minutes)
#   bash scripts/gpu_check.sh capped bench8k       # some sections
# Each section is bounded by a timeout (SIGABRT: python -X faulthandler prints where it hung);
# every result also goes to $OUT (default /tmp/gpu_check), and a summary table is printed last.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export OUT=$out PYTHONUNBUFFERED=1
sections=("$@")
[ ${#sections[@]} -gt 0 ] || sections=(tests capped bench8k bench64k profile generate qlora)
summary=()

if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

echo "== environment"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda,
'|', torch.cuda.get_device_name(0), '|', torch.cuda.device_count(), 'GPU(s) | transformers',
transformers.__version__)"
echo "$(nproc) CPUs, $(free -g | awk '/Mem:/ {print $2}') GB RAM"

echo "== build (no network: the packages already installed)"
start=$SECONDS
$PY -m pip install -q --no-build-isolation --no-deps --no-index . >"$out/build.txt" 2>&1 ||
  { tail -30 "$out/build.txt"; exit 1; }
echo "built in $((SECONDS - start)) s"

# run NAME SECONDS COMMAND...: one section, bounded, its output in $out/NAME.txt
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  local begin=$SECONDS
  (cd /tmp && timeout -s ABRT "$limit" "$@") 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-10s exit %3s in %4s s' "$name" "$rc" "$((SECONDS - begin))")")
}

here=$PWD
gpu="$PY -X faulthandler $here/scripts/gpu"
llama="--model llama --layers 24 --hidden 2560 --intermediate 6912 --heads 20 --kv-heads 4
       --vocab 32000 --seq 1024 --one-model --repeats 5"
for s in "${sections[@]}"; do
  case $s in
    tests)
      run tests 420 $PY -X faulthandler -m pytest -q -p no:cacheprovider -rs \
        "$here/tests/test_gpu.py" "$here/tests/test_trainer_gpu.py" \
        "$here/tests/test_fused_dequant.py" "$here/tests/test_generate_prefetch.py" ;;
    capped) PYTHONPATH=$here/scripts/gpu${PYTHONPATH:+:$PYTHONPATH} run capped 300 $gpu/capped.py ;;
    bench8k)
      run bench8k 300 $PY -X faulthandler -m roundpipe.bench pipeline $llama --batch 8 \
        --microbatches 4 --iters 2 --modes sync async exact torch+recompute fsdp2-offload \
        --json "$out/bench8k.json" ;;
    bench64k)
      run bench64k 420 $PY -X faulthandler -m roundpipe.bench pipeline $llama --batch 64 \
        --microbatches 16 --iters 1 --modes async exact torch+recompute fsdp2-offload \
        --json "$out/bench64k.json" ;;
    profile) PYTHONPATH=$here/scripts/gpu${PYTHONPATH:+:$PYTHONPATH} run profile 240 $gpu/profile_call.py ;;
    generate)
      run generate 240 $PY -X faulthandler -m roundpipe.bench generate --device cuda:0 \
        --dtype bfloat16 --layers 8 --hidden 2048 --heads 16 --kv-heads 8 --vocab 32000 \
        --prompt 64 --new-tokens 16 --batch 1 16 --repeats 5 --frozen-dtype nf4 \
        --json "$out/generate.json" ;;
    qlora)
      run qlora 240 $PY -X faulthandler -m roundpipe.bench qlora --device cuda:0 --hidden 2048 \
        --layers 4 --configs 1x512 4x512 --repeats 5 --json "$out/qlora.json" ;;
    plans) PYTHONPATH=$here/scripts/gpu${PYTHONPATH:+:$PYTHONPATH} run plans 420 $gpu/plans.py ;;
    *) echo "unknown section $s (tests capped bench8k bench64k profile generate qlora plans)"
       exit 2 ;;
  esac
done

echo "== summary"
printf '%s\n' "${summary[@]}"
grep -h -E "^ *(sync|async|exact): (first loss|bound)|x of it|tokens/step" \
  "$out"/capped.txt "$out"/bench8k.txt "$out"/bench64k.txt "$out"/plans.txt 2>/dev/null
! printf '%s\n' "${summary[@]}" | grep -qv "exit   0"
