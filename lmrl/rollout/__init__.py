"""Generation backends behind one `Generator` protocol.

`HFGenerator` runs any Hugging Face causal LM with its own KV-cached decode loop; it returns a
`Rollout` (token ids, masks, sampling log-probs, texts) with `n` contiguous completions per prompt.
"""

from lmrl.rollout.base import Generator, Rollout, SamplingParams
from lmrl.rollout.hf import HFGenerator

__all__ = ["Generator", "HFGenerator", "Rollout", "SamplingParams"]
