#!/usr/bin/env bash
# Install PyTorch into the given interpreter's environment without pulling a multi-GB CUDA build
# onto a machine that has no GPU.
#   - torch already importable: nothing to do.
#   - an NVIDIA GPU (nvidia-smi answers): the default build from the package index.
#   - no GPU: the CPU build. A wheel already on local disk (pip's find-links) is preferred;
#     otherwise PyTorch's CPU index is used.
# Override with TORCH_SPEC (default torch==2.13.0 for the CPU path) or TORCH_INDEX_URL.
set -euo pipefail
py=${1:-python3}
if "$py" -c "import torch" 2>/dev/null; then
    echo "torch $("$py" -c 'import torch; print(torch.__version__)') already installed"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "GPU found: installing the default torch build"
    "$py" -m pip install -q "${TORCH_SPEC:-torch>=2.4}"
    exit 0
fi
spec=${TORCH_SPEC:-torch==2.13.0}
echo "no GPU: installing the CPU build ($spec)"
# the wheel alone from local disk (pip's find-links), then its dependencies from the usual index:
# torch itself is then satisfied and nothing large is downloaded
if "$py" -m pip install -q --no-index --no-deps "$spec" 2>/dev/null; then
    "$py" -m pip install -q "$spec"
    exit 0
fi
"$py" -m pip install -q "$spec" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
