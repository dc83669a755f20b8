"""Generation backends behind one `Generator` protocol.

`HFGenerator` runs any Hugging Face causal LM with its own KV-cached decode loop; it returns a
`Rollout` (token ids, masks, sampling log-probs, texts) with `n` contiguous completions per prompt;
`concat_rollouts` and `select_rollout` join rollouts and keep some of their rows. A `RemoteGenerator` holds
its own copy of the weights and takes new ones (`lmrl.rollout.vllm_engine.VLLMGenerator`, imported only when
used: vLLM is an optional extra).
"""

from lmrl.rollout.base import Generator, RemoteGenerator, Rollout, SamplingParams
from lmrl.rollout.hf import HFGenerator
from lmrl.rollout.ops import concat_rollouts, select_rollout

__all__ = ["Generator", "HFGenerator", "RemoteGenerator", "Rollout", "SamplingParams", "concat_rollouts", "select_rollout"]
