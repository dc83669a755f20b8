"""A multi-turn environment that shows an image: a wrong answer to the digits task is shown the question again,
its image and all, for one more try (docs/agents.md, "An environment that shows images").

    lmrl train model.name_or_path=tiny-vision env.name=examples/look_again_env.py:LookAgain env.max_turns=2 \
        env.max_tokens=48 reward.functions=[env]

The observation holds the processor's image token once per image in `Step.images` (here the row's own prompt,
`<image>digit+3=`); the image's tokens are expanded in the episode's sequence, read by the next turn and by the
trainer's forward, never trained on. A row's image is a PIL image (the built-in task) or a path (a data file).
"""

from lmrl.envs import Step


class LookAgain:
    def __init__(self, row):
        self.question, self.image, self.answer, self.tries = row["prompt"], row["image"], row["answer"], 0

    def step(self, text, token_ids):
        self.tries += 1
        if text.strip() == self.answer:
            return Step(reward=1.0 / self.tries, done=True)
        return Step(observation=f"\n{self.question}", images=[self.image], reward=0.0, info={"wrong_answers": 1.0})
