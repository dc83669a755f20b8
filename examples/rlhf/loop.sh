#!/bin/bash
# The RLHF loop on a laptop (docs/rewards.md, "The whole loop on a laptop"): rounds of preference pairs from the
# current policy's own samples (the task's verifier decides), a reward model trained on every round's pairs, and GRPO
# against it with a KL term. A round's policy is kept only where the task's verifier says it is better than the best so
# far (held-out exact match, eval/accuracy at its last step against its first): the next round starts from the best.
#
#     bash examples/rlhf/loop.sh runs/rlhf 5        # OUT ROUNDS; 2-8 minutes a round on a 2-core CPU (later rounds
#                                                   # train their reward model on more pairs)
#
# Round 0 samples the shipped model. Every GRPO run is verified on the task's held-out sums (eval/accuracy beside
# eval/learned_reward), warns when the learned reward is being hacked, and keeps its best evaluation's model in best/
# (train.keep_best). The scale (for a quick try; the documented numbers use the defaults): PROMPTS training prompts
# sampled for pairs (4000), RM_EPOCHS (3), STEPS of GRPO a round (100), EVAL_PROMPTS held-out sums (500).
set -euo pipefail
OUT=${1:-runs/rlhf}; ROUNDS=${2:-5}
PROMPTS=${PROMPTS:-4000}; RM_EPOCHS=${RM_EPOCHS:-3}; STEPS=${STEPS:-100}; EVAL_PROMPTS=${EVAL_PROMPTS:-500}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
POLICY=tiny-addition  # the policy the next round starts from: the best so far
PAIRS=()
accuracy() {  # eval/accuracy at the first or last evaluation of a run's metrics.jsonl
  python -c "import json, sys; e = [r['eval/accuracy'] for r in map(json.loads, open(sys.argv[1])) if 'eval/accuracy' in r]; print(e[int(sys.argv[2])])" "$1" "$2"
}
for ((r = 1; r <= ROUNDS; r++)); do
  # 1. pairs: every distinct wrong sample of the last policy against a right one, plus every earlier round's
  python "$HERE/make_pairs.py" --model "${SAMPLER:-$POLICY}" --out "$OUT/pairs-$r.jsonl" --every-wrong \
      --prompts "$PROMPTS" --append "${PAIRS[@]}"
  PAIRS=("$OUT/pairs-$r.jsonl")
  # 2. a reward model on the shipped model's backbone (a new score head), on all of them
  lmrl train-rm data.path="$OUT/pairs-$r.jsonl" data.eval_fraction=0.05 train.epochs="$RM_EPOCHS" train.batch_size=64 \
      optim.lr=3e-4 train.threads=1 train.output_dir="$OUT/rm-$r" log.console=false
  # 3. GRPO against it from the current policy (the shipped model's preset written out: a directory gets none; and
  #    its 4.5-minute limit lifted, so that a slow machine runs the same steps)
  lmrl train "reward.functions=[{fn: reward_model, path: $OUT/rm-$r/final, normalize: true}]" \
      model.name_or_path="$POLICY" algorithm.kl_coef=0.05 train.steps="$STEPS" train.eval_every=10 \
      rollout.prompts_per_step=32 rollout.group_size=8 rollout.max_new_tokens=4 optim.lr=1e-4 \
      data.num_eval_prompts="$EVAL_PROMPTS" train.keep_best=true train.max_minutes=null train.threads=1 \
      train.output_dir="$OUT/grpo-$r" log.console=false
  before=$(accuracy "$OUT/grpo-$r/metrics.jsonl" 0); after=$(accuracy "$OUT/grpo-$r/metrics.jsonl" -1)
  # the next round's pairs come from this round's policy (its mistakes, hacks included), whichever is kept
  SAMPLER="$OUT/grpo-$r/final"
  if python -c "import sys; sys.exit(not float(sys.argv[2]) > float(sys.argv[1]))" "$before" "$after"; then
    POLICY="$OUT/grpo-$r/final"
  fi
  echo "round $r: held-out accuracy $before -> $after; the next round starts from $POLICY"
done
