#!/usr/bin/env bash
# On the GPU machine (no package index there): install the wheels scripts/gpu_wheels.py put in .whl/,
# then run the whole suite on CUDA, the GPU benchmark against TRL, the generation backends and a real-size
# vision-language policy (benchmarks/gpu_vision.py). Output goes to $OUT when it is set
# (the device tool brings that folder back), else to gpu-out/.
#   here:  python scripts/gpu_wheels.py
#   there: bash scripts/gpu_run.sh            (the device tool's run, with carry=[".whl"])
# Each part has a time limit (seconds; default 540, so that one part fits a device call of 10 minutes): GPU_SUITE_S,
# GPU_BENCH_S, GPU_GEN_S, GPU_VISION_S, GPU_DECODE_S. GPU_PARTS=decode (not a default part) times the decode engine's GPU
# set-up (issue 51: benchmarks/generation.py --preset qwen0.5b, tokens/s, ms per step and the device's bound), about
# 1-3 minutes. GPU_PARTS=update (not a default part) times lmrl's rest of a step alone under
# four settings, each run at most GPU_UPDATE_S (default 130) seconds, GPU_UPDATE_ARGS added to each (--tiny: a check on a CPU). The suite runs on GPU_WORKERS pytest workers (default 14), each test at most 180 s; GPU_TESTS
# narrows it (pytest arguments; default: tests), GPU_PARTS chooses the parts (default: suite bench gen vision; the whole suite
# alone took more than 320 s on 8 workers of an H100 machine, and did not end in 465 s on 12 beside the vision part,
# 2026-11-27, so give each part a call of its own; the bench part with --steps 3 took 143 s). The generation table is recorded into $OUT/results/ (copy it to
# benchmarks/results/ and run `make figures` to show it in the docs).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
# the `lmrl` command pip would install with the package (examples' scripts and the docs call it)
mkdir -p /tmp/site/bin && printf '#!/bin/sh\nexec python3 -m lmrl.cli "$@"\n' > /tmp/site/bin/lmrl && chmod +x /tmp/site/bin/lmrl
# the wheels for every python3 the tests start, also those given a PYTHONPATH of their own
echo /tmp/site > "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/lmrl-gpu-wheels.pth" \
    || echo "warning: the wheels are on PYTHONPATH only"
nvidia-smi -L | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$out/device.txt"
limit() { timeout -s INT -k 20 "$@"; }  # SIGINT first: pytest and the benchmarks print what they have
parts=" ${GPU_PARTS:-suite bench gen vision} "
suite=0 bench=0 gen=0 vision=0
if [[ $parts == *" suite "* ]]; then
    limit "${GPU_SUITE_S:-540}" python3 -m pytest -q -p no:cacheprovider -n "${GPU_WORKERS:-14}" --dist loadfile \
        --timeout 180 -rfE ${GPU_TESTS:-tests} 2>&1 | tee "$out/suite.txt"
    suite=${PIPESTATUS[0]}
fi
if [[ $parts == *" bench "* ]]; then
    limit "${GPU_BENCH_S:-540}" python3 benchmarks/gpu_vs_trl.py 2>&1 | tee "$out/gpu_vs_trl.txt"
    bench=${PIPESTATUS[0]}
fi
if [[ $parts == *" gen "* ]]; then  # generation tokens/s of the backends (vLLM's column where its CUDA build is installed)
    backends="lmrl hf"
    python3 -c "import vllm" 2>/dev/null && backends="lmrl vllm hf"
    LMRL_RESULTS_DIR="$out/results" limit "${GPU_GEN_S:-540}" python3 benchmarks/generation.py \
        --preset shipped 30m 100m --backends $backends --repeats 3 --record generation-gpu 2>&1 | tee "$out/generation.txt"
    gen=${PIPESTATUS[0]}
fi
decode=0
if [[ $parts == *" decode "* ]]; then  # the decode engine's GPU set-up: 512 rows x 256 tokens, Qwen2-0.5B's shape, bf16
    backends="hf lmrl engine"
    python3 -c "import vllm" 2>/dev/null && backends="hf lmrl engine vllm"
    LMRL_RESULTS_DIR="$out/results" limit "${GPU_DECODE_S:-540}" python3 benchmarks/generation.py --preset qwen0.5b \
        --backends $backends --modes no-eos --repeats 2 --record generation-gpu-decode 2>&1 | tee "$out/decode.txt"
    decode=${PIPESTATUS[0]}
fi
if [[ $parts == *" vision "* ]]; then  # a Qwen2.5-VL of the 3B model's shape (random weights) through lmrl's Trainer
    limit "${GPU_VISION_S:-540}" python3 benchmarks/gpu_vision.py 2>&1 | tee "$out/gpu_vision.txt"
    vision=${PIPESTATUS[0]}
fi
update=0
if [[ $parts == *" update "* ]]; then  # not by default: lmrl alone, its rest of a step under each setting suspected of
    # making it slower than TRL's (docs/not-run-here.md, the third run), each run at most GPU_UPDATE_S seconds
    # (packed by default since issue 52; train.packing=false is the padded update, the last one micro-batch cut by tokens)
    for set in "" "train.packing=false" "train.share_prompt=false" "optim.micro_batch_size=512 optim.micro_batch_tokens=65536"; do
        limit "${GPU_UPDATE_S:-130}" python3 benchmarks/gpu_vs_trl.py --steps 3 --trainers lmrl ${GPU_UPDATE_ARGS:-} \
            ${set:+--lmrl-set $set} 2>&1 | grep -v "Loading weights\|Writing model shards" | tee -a "$out/update.txt"
        update=$(( update || PIPESTATUS[0] ))
    done
fi
echo "suite exit $suite, benchmark exit $bench, generation exit $gen, decode exit $decode, vision exit $vision, update exit $update"
exit $(( suite || bench || gen || vision || update ))
