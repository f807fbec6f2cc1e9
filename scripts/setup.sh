#!/usr/bin/env bash
# Create ./.venv and install phalanx into it (EXTRAS=test adds the test tools).
# A torch already in the venv is kept (install your ROCm or CUDA build first to use it). Otherwise
# torch 2.13.0 is installed from $TORCH_INDEX_URL if set, else from pip's configured indexes.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  # Pinned: a loose `torch` requirement would make pip choose a multi-GB CUDA build on its own.
  pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
python -c "import torch; print(f'phalanx ready: torch {torch.__version__}, GPU: {torch.cuda.is_available()}')"
