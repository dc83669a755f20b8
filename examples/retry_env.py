"""A custom multi-turn environment: up to `env.max_turns` tries at a sum; a wrong answer hears the question again.

    lmrl train env.name=examples/retry_env.py:Retry env.max_turns=3 reward.functions=[env]

Each dataset row starts an episode (`Retry(row)`); `step` gets every model turn (its text and token ids).
The reward is 1 for a right first answer, 1/2 for a right second one, and so on; the observations (the
repeated question) are in the sequence the model reads, never in the loss.
"""

from lmrl.envs import Step


class Retry:
    def __init__(self, row):
        self.question, self.answer, self.tries = row["prompt"], row["answer"], 0

    def step(self, text, token_ids):
        self.tries += 1
        if text.strip() == self.answer:
            return Step(reward=1.0 / self.tries, done=True)
        return Step(observation=f"\n{self.question}", reward=0.0, info={"wrong_answers": 1.0})
