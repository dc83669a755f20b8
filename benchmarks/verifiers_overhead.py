"""What a verifiers environment costs per step over lmrl's own single-turn rollout: the same prompts, model and
sampling, K episodes per step, through `VerifiersEnvironment` (verifiers' interception server and harness, the
gateway, the rubric) against one `Generator.generate` call (the rubric not run).

    python benchmarks/verifiers_overhead.py                 # tests/envs/vf_sums.py, 4 tasks x 8 episodes, 5 steps
    python benchmarks/verifiers_overhead.py --record        # and benchmarks/results/verifiers-overhead.MACHINE.json

The model is the shipped tiny-addition with a pass-through chat template (as tests/envs/test_verifiers.py makes
it), one torch thread. Printed: the median wall time of a step of each, and their difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--record", action="store_true", help="write the table to benchmarks/results/ (docs/agents.md)")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmrl.agents.verifiers import VerifiersEnvironment, load_verifiers_environment
    from lmrl.models.prompt_encoding import encode_prompts
    from lmrl.rollout.base import SamplingParams
    from lmrl.rollout.hf import HFGenerator
    from lmrl.rollout.multiturn import generate_episodes
    from tests.envs.test_verifiers import chat_addition_model

    torch.set_num_threads(1)
    where = chat_addition_model(Path(tempfile.mkdtemp()))
    tok = AutoTokenizer.from_pretrained(where)
    gen = HFGenerator(AutoModelForCausalLM.from_pretrained(where).eval(), tok, seed=0)
    env = VerifiersEnvironment(load_verifiers_environment(f"verifiers:{ROOT / 'tests/envs/vf_sums.py'}"))
    rows = env.rows()
    prompts = encode_prompts(tok, [r["prompt"] for r in rows], 64, use_chat_template=True)
    params = SamplingParams(max_new_tokens=6)
    plain, verifiers = [], []
    for _ in range(args.steps + 1):  # the first of each warms up
        start = time.perf_counter()
        gen.generate(prompts, args.group_size, params)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        episodes = generate_episodes(gen, tok, prompts, rows, args.group_size, params, env, max_turns=1)
        verifiers.append(time.perf_counter() - start)
        assert episodes.metrics["agent/failures"] == 0
    a, b = statistics.median(plain[1:]), statistics.median(verifiers[1:])
    print(f"{len(rows)} tasks x {args.group_size} episodes, median of {args.steps} steps, load {os.getloadavg()[0]:.1f}")
    per_episode = (b - a) / (len(rows) * args.group_size) * 1000
    print(f"lmrl's rollout: {a:.3f} s/step   verifiers environment: {b:.3f} s/step   overhead {b - a:.3f} s/step "
          f"({per_episode:.1f} ms per episode)")
    if args.record:
        from recording import Column, record

        record("verifiers-overhead", [Column("rollout"), Column("seconds", "s per step (median)", "{:.3f}")],
               [{"rollout": "lmrl's own single-turn rollout (`Generator.generate`)", "seconds": a},
                {"rollout": "the verifiers environment (harness, interception, gateway, rubric)", "seconds": b}],
               values={"per_episode_ms": f"{per_episode:.0f} ms"},
               note=f"{len(rows)} tasks x {args.group_size} episodes per step, median of {args.steps} steps after one "
                    f"to warm up, one torch thread; shared with other jobs, load average about "
                    f"{os.getloadavg()[0]:.0f}.")


if __name__ == "__main__":
    main()
