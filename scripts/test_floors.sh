#!/usr/bin/env bash
# The declared floors: installs the lowest versions pyproject.toml allows (requirements-floors.txt:
# torch, transformers, peft, tokenizers, accelerate, trl, datasets) together into .venv-floors and
# runs the Hugging Face, generation, Trainer and loading tests there, with the RoundPipe that
# scripts/setup.sh built and installed into .venv (the same Python: its package directory alone
# goes on the path). Run by scripts/test.sh after setup; on its own: bash scripts/test_floors.sh.
# The install is skipped when requirements-floors.txt did not change since the last one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -x .venv/bin/python ] || { echo "run scripts/setup.sh first (it builds RoundPipe)"; exit 1; }

echo "== declared floors (requirements-floors.txt) in .venv-floors"
[ -x .venv-floors/bin/python ] || python3 -m venv .venv-floors
req=$(sha256sum requirements-floors.txt | cut -d' ' -f1)
if [ -f .venv-floors/.stamp-requirements ] && [ "$(cat .venv-floors/.stamp-requirements)" = "$req" ]; then
  echo "   requirements-floors.txt unchanged, already installed"
else
  start=$SECONDS
  .venv-floors/bin/python -m pip install -q --disable-pip-version-check -r requirements-floors.txt
  echo "$req" > .venv-floors/.stamp-requirements
  echo "   installed in $((SECONDS - start)) s"
fi
.venv-floors/bin/python -c "import torch, transformers, peft, accelerate, trl; print('   torch',
torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__,
'| accelerate', accelerate.__version__, '| trl', trl.__version__)"

site=$(.venv/bin/python -c "import os, roundpipe; print(os.path.dirname(roundpipe.__file__))")
mkdir -p build/floors
ln -sfn "$site" build/floors/roundpipe
PYTHONPATH=build/floors .venv-floors/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_hf.py tests/test_generate.py tests/test_trainer.py tests/test_trainer_sft.py \
  tests/test_trainer_modes.py tests/test_loading.py tests/test_layer_host_waits.py
