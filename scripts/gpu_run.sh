#!/usr/bin/env bash
# On the GPU machine (no package index there): install the wheels scripts/gpu_wheels.py put in .whl/,
# then run the whole suite on CUDA, the GPU benchmark against TRL and the generation backends. Output goes to $OUT when it is set
# (the device tool brings that folder back), else to gpu-out/.
#   here:  python scripts/gpu_wheels.py
#   there: bash scripts/gpu_run.sh            (the device tool's run, with carry=[".whl"])
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/suite.txt"
suite=${PIPESTATUS[0]}
python3 benchmarks/gpu_vs_trl.py 2>&1 | tee "$out/gpu_vs_trl.txt"
bench=${PIPESTATUS[0]}
# generation tokens/s of the backends (vLLM's column only where its CUDA build is installed)
backends="lmrl hf"
python3 -c "import vllm" 2>/dev/null && backends="lmrl vllm hf"
python3 benchmarks/generation.py --preset shipped 30m 100m --backends $backends --repeats 3 2>&1 | tee "$out/generation.txt"
gen=${PIPESTATUS[0]}
echo "suite exit $suite, benchmark exit $bench, generation exit $gen"
exit $(( suite || bench || gen ))
