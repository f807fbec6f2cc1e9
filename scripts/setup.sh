#!/usr/bin/env bash
# Create ./.venv and install phalanx into it. EXTRAS picks pip extras: by default `all` (serving, the run
# store and dashboard, exports, PostgreSQL, TensorBoard: what the README's quick start uses after training);
# EXTRAS= (empty) installs the core alone, which trains; EXTRAS=test adds the quick tier's test tools,
# EXTRAS=test-all also llama-cpp-python (built from source: the whole suite's GGUF tests).
# A torch already in the venv is kept (install your ROCm or CUDA build first to use it). Otherwise
# torch 2.13.0 is installed from $TORCH_INDEX_URL if set, else from pip's configured indexes.
# Each step says what it installs and about how long it takes the first time on 2 cores; a second run
# finds everything installed and takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() { echo "setup [$((SECONDS - started)) s]: $*"; }
EXTRAS=${EXTRAS-all}  # unset: all; set and empty: the core
[ -x .venv/bin/python ] || { step "creating .venv"; "${PYTHON:-python3}" -m venv .venv; }
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  # Pinned: a loose `torch` requirement would make pip choose a multi-GB CUDA build on its own.
  step "installing torch ${TORCH_VERSION:-2.13.0} (about 20 s from a local wheel, minutes from the network)"
  pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# What each extra brings that takes long to install: present, pip only checks (seconds).
case ",${EXTRAS}," in
  *,test-all,*) probe="import phalanx, xdist, lm_eval, llama_cpp" ;;
  *,test,*) probe="import phalanx, xdist, lm_eval" ;;
  *,all,*) probe="import phalanx, fastapi, sqlalchemy, llguidance, tensorboard" ;;
  *) probe="import phalanx" ;;
esac
if python -c "$probe" 2>/dev/null; then
  step "checking that phalanx${EXTRAS:+ [$EXTRAS]} is installed and current (seconds)"
else
  case ",${EXTRAS}," in
    *,test-all,*) step "installing phalanx with [${EXTRAS}]: about 2 minutes, plus 3-10 minutes to build llama-cpp-python from source the first time (pip keeps the wheel)" ;;
    *,test,*) step "installing phalanx with [${EXTRAS}]: about 2 minutes (Ray, transformers, playwright, lm-eval, ...)" ;;
    *,all,*) step "installing phalanx with [${EXTRAS}]: about 40 s (serving, the run store and dashboard, exports, ...)" ;;
    ,,) step "installing phalanx's core (it trains; no serving, store or exports): about 30 s" ;;
    *) step "installing phalanx with [${EXTRAS}]" ;;
  esac
fi
pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
python -c "import torch; print(f'phalanx ready: torch {torch.__version__}, GPU: {torch.cuda.is_available()}')"
step "done"
