#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU and no network (its python3 already holds torch
# with CUDA, nanobind, scikit-build-core, cmake, ninja, pytest, accelerate and a
# transformers/peft; wheels of newer ones in .whl/ are installed to /tmp/site first, see
# /work/.library/device/README.md). It runs in CALLS, each one device command that fits the
# device tool's limits by construction: its sections' time limits plus the build add up to at
# most 540 s (a command may run 600 s), and all it writes comes back as ONE file,
# $OUT/gpu_check_<call>.tar.gz (at most 8 files come back), beside a summary printed last.
#
#   call 1  tests     tests/test_gpu.py, tests/test_trainer_gpu.py and the CUDA cases of
#                     tests/test_fused_dequant.py (the compiled dequantization on CUDA)
#           capped    the 1.82B Llama under a 3 GB cap: sync, async, exact; first loss
#                     against plain HF
#   call 2  bench8k   bench pipeline, 1.82B Llama, 8 x 1024 tokens per step: sync, async,
#                     exact against plain HF with gradient checkpointing and FSDP2 with CPU
#                     offload; each mode's bound
#           generate  generation through the pipeline against transformers' generate and its
#                     bound, an NF4 base
#           qlora     LoRA on an NF4 base against a bf16 base, upload-bound (1 x 512), 4 x 512
#   call 3  bench64k  bench pipeline at 64 x 1024 tokens per step (fine-tuning's usual 64k)
#           profile   one exact-mode call of the 1.82B under torch.profiler and cProfile, and
#                     the CUDA memory history of two calls
#   plans   plans     the automatic stage plan against fixed ones at 4k and 64k tokens
#   long    longseq   the longest sequence that trains under a 24 GB cap, 1.7B and 8B
#                     geometries, plain and packed, beside sizing's prediction (issue 46)
#
# The order: a session lent a device runs call 1 first (correctness and the memory bound), then
# call 2 (the speed figures at 8k tokens per step) if its time allows; the next one calls 3,
# plans and long. Each call's command (timeout_s 600):
#
#   bash scripts/gpu_check.sh 1                 # or 2, 3, plans; or section names: capped qlora
#   bash scripts/gpu_check.sh --list            # the calls, their sections and time limits
#   SMOKE=1 bash scripts/gpu_check.sh all       # dry run on the CPU, tiny sizes (CI runs it)
#
# Each section is bounded by a timeout (SIGABRT: python -X faulthandler prints where it hung; no
# core file is written).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# section -> time limit (s); call -> sections
declare -A LIMIT=([tests]=200 [capped]=180 [bench8k]=240 [generate]=100 [qlora]=100
                  [bench64k]=360 [profile]=120 [plans]=480 [longseq]=480)
declare -A CALL=([1]="tests capped" [2]="bench8k generate qlora" [3]="bench64k profile"
                 [plans]="plans" [long]="longseq")
BUILD_S=40  # the build (16 s measured) and the environment's lines, with room

if [ "${1:-}" = --list ]; then
  for c in 1 2 3 plans long; do
    total=$BUILD_S
    line=""
    for s in ${CALL[$c]}; do total=$((total + LIMIT[$s])); line+=" $s=${LIMIT[$s]}"; done
    echo "call $c:$line build=$BUILD_S total=$total"
  done
  exit 0
fi

SMOKE=${SMOKE:-0}
export SMOKE PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
out=${OUT:-/tmp/gpu_check}
name=$(IFS=_; echo "${*:-1}")
work=$(mktemp -d)
mkdir -p "$out"
sections=()
for arg in "${@:-1}"; do
  if [ "$arg" = all ]; then
    sections+=(tests capped bench8k generate qlora bench64k profile plans longseq)
  elif [ -n "${CALL[$arg]+x}" ]; then sections+=(${CALL[$arg]})
  elif [ -n "${LIMIT[$arg]+x}" ]; then sections+=("$arg")
  else echo "unknown call or section $arg (calls: 1 2 3 plans long all; sections: ${!LIMIT[*]})"
       exit 2
  fi
done
ulimit -c 0  # a SIGABRT of a process holding tens of GB must not write a core file
summary=()

if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

echo "== environment"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda,
'|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', '|',
torch.cuda.device_count(), 'GPU(s) | transformers', transformers.__version__)"
echo "$(nproc) CPUs, $(free -g | awk '/Mem:/ {print $2}') GB RAM"

if [ "$SMOKE" != 1 ]; then
  echo "== build (no network: the packages already installed)"
  start=$SECONDS
  $PY -m pip install -q --no-build-isolation --no-deps --no-index . >"$work/build.txt" 2>&1 ||
    { tail -30 "$work/build.txt"; exit 1; }
  echo "built in $((SECONDS - start)) s"
fi

# run NAME COMMAND...: one section, bounded by its limit, its output in NAME.txt; its files
# (OUT=the work folder) go into the call's tarball
run() {
  local name=$1
  shift
  echo "== $name (limit ${LIMIT[$name]} s)"
  local begin=$SECONDS
  (cd /tmp && OUT=$work timeout -s ABRT "${LIMIT[$name]}" "$@") 2>&1 | tee "$work/$name.txt"
  local rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-10s exit %3s in %4s s' "$name" "$rc" "$((SECONDS - begin))")")
}

here=$PWD
gpu="$PY -X faulthandler $here/scripts/gpu"
export PYTHONPATH=$here/scripts/gpu${PYTHONPATH:+:$PYTHONPATH}
if [ "$SMOKE" = 1 ]; then  # tiny sizes on the CPU: every command line runs, nothing is measured
  device=cpu
  llama="--model llama --layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2
         --vocab 320 --seq 32 --one-model --repeats 5 --devices cpu"
  big="--batch 4 --microbatches 2 --iters 1"
  huge="--batch 8 --microbatches 4 --iters 1"
  gen="--layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 320 --prompt 8 --new-tokens 2
       --batch 1 2 --repeats 5"
  lora="--hidden 64 --layers 2 --configs 1x16 2x16 --layer-hidden 64 --layer-intermediate 128
        --repeats 5"
else
  device=cuda:0
  llama="--model llama --layers 24 --hidden 2560 --intermediate 6912 --heads 20 --kv-heads 4
         --vocab 32000 --seq 1024 --one-model --repeats 5"
  big="--batch 8 --microbatches 4 --iters 2"
  huge="--batch 64 --microbatches 16 --iters 1"
  gen="--layers 8 --hidden 2048 --heads 16 --kv-heads 8 --vocab 32000 --prompt 64
       --new-tokens 16 --batch 1 16 --repeats 5"
  lora="--hidden 2048 --layers 4 --configs 1x512 4x512 --repeats 5"
fi
for s in "${sections[@]}"; do
  case $s in
    tests)
      run tests $PY -X faulthandler -m pytest -q -p no:cacheprovider -rs \
        "$here/tests/test_gpu.py" "$here/tests/test_trainer_gpu.py" \
        "$here/tests/test_fused_dequant.py" -k "cuda or gpu or test_gpu or trainer_gpu" ;;
    capped) run capped $gpu/capped.py ;;
    bench8k)
      run bench8k $PY -X faulthandler -m roundpipe.bench pipeline $llama $big \
        --modes sync async exact torch+recompute fsdp2-offload --json "$work/bench8k.json" ;;
    bench64k)
      run bench64k $PY -X faulthandler -m roundpipe.bench pipeline $llama $huge \
        --modes async exact torch+recompute fsdp2-offload --json "$work/bench64k.json" ;;
    profile) run profile $gpu/profile_call.py ;;
    generate)
      run generate $PY -X faulthandler -m roundpipe.bench generate --device $device \
        --dtype bfloat16 $gen --frozen-dtype nf4 --json "$work/generate.json" ;;
    qlora)
      run qlora $PY -X faulthandler -m roundpipe.bench qlora --device $device $lora \
        --json "$work/qlora.json" ;;
    plans) run plans $gpu/plans.py ;;
    longseq) run longseq $gpu/long_seq.py ;;
  esac
done

echo "== summary ($name)"
printf '%s\n' "${summary[@]}" | tee "$work/summary.txt"
grep -h -E "^ *(sync|async|exact): (first loss|bound)|x of it|tokens/step" \
  "$work"/capped.txt "$work"/bench8k.txt "$work"/bench64k.txt "$work"/plans.txt 2>/dev/null
tar czf "$out/gpu_check_$name.tar.gz" -C "$work" . && rm -rf "$work"
echo "results: $out/gpu_check_$name.tar.gz"
! printf '%s\n' "${summary[@]}" | grep -qv "exit   0"
