"""Generation backends behind one `Generator` protocol.

`HFGenerator` runs any Hugging Face causal LM with its own KV-cached decode loop; it returns a
`Rollout` (token ids, masks, sampling log-probs, texts) with `n` contiguous completions per prompt;
`concat_rollouts` and `select_rollout` join rollouts and keep some of their rows.
"""

from lmrl.rollout.base import Generator, Rollout, SamplingParams
from lmrl.rollout.hf import HFGenerator
from lmrl.rollout.ops import concat_rollouts, select_rollout

__all__ = ["Generator", "HFGenerator", "Rollout", "SamplingParams", "concat_rollouts", "select_rollout"]
