"""lmrl's decode engine: everything that samples from the policy in lmrl's own process goes through it.

`DecodeEngine` (`engine.py`) is the loop: rows join when there is room and leave the step they end (continuous
batching); a training batch is many requests, a server's requests join a running decode. `KVCache` (`cache.py`)
holds every key / value head once and a prompt's keys once for all its rows; `LlamaStep` (`llama.py`) is the
module-by-module decode step of Llama / Qwen2 / Qwen3 models with shared-prompt attention that reads each row's live columns,
`ModelStep` (`model_step.py`) every other model's step through its own forward;
`sampling.py` samples on the device; `layers.py` holds the linears, MLP and RMSNorm the step runs.

The engine works on token ids only: texts, stop strings (a callable) and the generator protocol are `lmrl.rollout`'s.
"""

from lmrl.engine.engine import DecodeEngine, Ended, Request
from lmrl.engine.llama import supports

__all__ = ["DecodeEngine", "Ended", "Request", "supports"]
