"""The critic of PPO: a transformer backbone with a scalar value head.

V(s_t) estimates the return from state s_t = (prompt, response tokens before t). The value of
response token t is read at position t - 1, the last position the model has seen before token t is
emitted: the same shift as log-probs (logits at position t - 1 score token t). GAE then uses
delta_t = r_t + gamma V(s_{t+1}) - V(s_t) over these aligned [B, T] values.

The head is initialised with std 1/sqrt(H + 1) as in Ziegler et al. 2019 ("Fine-Tuning Language
Models from Human Preferences", lm-human-preferences): small values to start from, but not zero,
which would block every gradient to the backbone at the first step.
"""

from __future__ import annotations

import copy
import math
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lmrl.models.forward import padded_to, position_ids_from_mask, response_hidden, trimmed
from lmrl.models.loading import DTYPES, _check_exists, _first_line
from lmrl.models.shared_prompt import packed_states

HEAD_FILE = "value_head.safetensors"


def _backbone_of(causal_lm: nn.Module) -> nn.Module:
    """The transformer of a causal LM without its lm_head (e.g. `LlamaForCausalLM.model`).

    `base_model` is the module named by `base_model_prefix`, the attribute every Hugging Face
    causal LM uses for its decoder stack; it is the model itself when there is no wrapper.
    """
    backbone = getattr(causal_lm, "base_model", causal_lm)
    if backbone is causal_lm and hasattr(causal_lm, "get_decoder"):
        backbone = causal_lm.get_decoder()
    return backbone


class ValueModel(nn.Module):
    """Backbone + Linear(H, 1): one value per position.

    Args:
        backbone: a Hugging Face base model (no lm_head) returning `last_hidden_state` [B, S, H].
        head_init_std: std of the head's weights; default 1/sqrt(H + 1). The bias starts at 0.

    The head is kept in float32 whatever the backbone's dtype: values are regression targets whose
    errors bf16 would round away.
    """

    def __init__(self, backbone: nn.Module, head_init_std: float | None = None):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        param = next(backbone.parameters())
        self.value_head = nn.Linear(hidden, 1, device=param.device, dtype=torch.float32)
        std = head_init_std if head_init_std is not None else 1.0 / math.sqrt(hidden + 1)
        nn.init.normal_(self.value_head.weight, std=std)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module, head_init_std: float | None = None) -> ValueModel:
        """A critic whose backbone starts as a copy of the policy's (separate weights, trained apart)."""
        backbone = copy.deepcopy(_backbone_of(policy))
        backbone.requires_grad_(True)
        return cls(backbone, head_init_std=head_init_std).train(policy.training)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        head_init_std: float | None = None,
        config_key: str = "critic.name_or_path",
    ) -> ValueModel:
        """Load a critic from a directory written by `save_pretrained`, or start one from a model.

        With a `value_head.safetensors` next to the weights (a saved critic), the head is restored;
        otherwise (any causal LM or base model path, e.g. a reward model's) the backbone is loaded
        with `AutoModel`, which drops the lm_head, and the head is freshly initialised.
        """
        from transformers import AutoModel

        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"critic.dtype: must be one of {['auto', *DTYPES]}, got {dtype!r}")
        path = _check_exists(name_or_path, config_key, "")
        try:
            backbone = AutoModel.from_pretrained(
                path, dtype="auto" if dtype == "auto" else DTYPES[dtype], trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as err:
            raise ValueError(f"{config_key}: cannot load {path!r}: {_first_line(err)}") from err
        model = cls(_backbone_of(backbone), head_init_std=head_init_std)
        head_path = os.path.join(path, HEAD_FILE)
        if os.path.isfile(head_path):
            model.value_head.load_state_dict(load_file(head_path))
        return model

    def save_pretrained(self, directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the backbone with `save_pretrained` and the head to `value_head.safetensors`. `state_dict`:
        this model's whole weights when its parameters are not (FSDP-sharded ones)."""
        os.makedirs(directory, exist_ok=True)
        if state_dict is None:
            state_dict = self.state_dict()
        backbone = {k.removeprefix("backbone."): v for k, v in state_dict.items() if k.startswith("backbone.")}
        self.backbone.save_pretrained(directory, state_dict=backbone)
        state = {k.removeprefix("value_head."): v.detach().float().cpu().contiguous()
                 for k, v in state_dict.items() if k.startswith("value_head.")}
        save_file(state, os.path.join(directory, HEAD_FILE))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values at every position.

        Args:
            input_ids: [B, S] token ids, left-padded.
            attention_mask: [B, S], 1 for real tokens.
            position_ids: [B, S]; default cumsum(attention_mask) - 1, as generation uses.

        Returns:
            [B, S] float32: V at each position (the value of the state after reading that token).
        """
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # [B, S, H]
        # [B, S], a copy: FSDP warns that a view as a module's output could lose its backward hook
        return self.value_head(hidden.float()).squeeze(-1).clone()

    def response_values(
        self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_response_tokens: int,
        share_prompt: bool = False,
        pack: bool = False,
    ) -> torch.Tensor:
        """Values aligned to the response tokens: V(state before token t) for each of the last T.

        Args:
            sequences: [B, S] prompt then response, left-padded.
            attention_mask: [B, S].
            num_response_tokens: T, 1 <= T < S.
            share_prompt: where rows share a prompt and the backbone allows it (Llama / Qwen2,
                `lmrl.models.shared_prompt`), run each distinct prompt through the backbone once, as the
                policy's forward does: the same values, less work.
            pack: run the real tokens only, as `lmrl.models.forward.response_forward` does (0 after a row's last
                real token).

        Returns:
            [B, T] float32: entry t is the value read at position S-T-1+t, the position just before
            response token t, so values[:, 0] is the value of the prompt alone.
        """
        seq_len = sequences.shape[1]
        t = num_response_tokens
        if not 1 <= t < seq_len:
            raise ValueError(
                f"num_response_tokens: must be in [1, {seq_len - 1}] for sequences of length {seq_len}, got {t}"
            )
        width = t
        if pack:
            sequences, attention_mask, t = trimmed(sequences, attention_mask, t)
        states = packed_states(self.backbone, sequences, attention_mask, position_ids_from_mask(attention_mask), t,
                               pack=pack) if share_prompt else None
        if states is not None:
            return states.scatter(self.value_head(states.hidden.float()).squeeze(-1), len(sequences), width)
        return padded_to(self(sequences, attention_mask)[:, -(t + 1) : -1], width)  # [B, T]


class PolicyValueHead(nn.Module):
    """PPO's value head on the policy's own backbone (`model.shared_critic`): Linear(H, 1) over the hidden
    states the policy's forward already computes, as TRL's AutoModelForCausalLMWithValueHead and trlx do.

    It holds only the head (its parameters are the critic's in the optimizer, at optim.critic_lr); the policy
    is passed to each call, so no weight is held twice. The value loss reaches the policy's backbone through the
    hidden states: one forward and one backward serve both losses (vf_coef weighs them), where a separate
    critic costs a second model's forward and backward.

    Args:
        hidden_size: the policy's hidden size H.
        device: where the head lives (the policy's device).
        head_init_std: std of the head's weights; default 1/sqrt(H + 1), as `ValueModel`'s.
    """

    def __init__(self, hidden_size: int, device: torch.device | str | None = None, head_init_std: float | None = None):
        super().__init__()
        self.value_head = nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
        nn.init.normal_(self.value_head.weight, std=head_init_std or 1.0 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def for_policy(cls, policy: nn.Module, head_init_std: float | None = None) -> PolicyValueHead:
        """A fresh head sized for `policy` (a causal LM), on its device."""
        hidden = policy.config.get_text_config(decoder=True).hidden_size
        return cls(hidden, device=next(policy.parameters()).device, head_init_std=head_init_std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] hidden states (the policy's, after its final norm) -> [B, T] float32 values."""
        return self.value_head(hidden.float()).squeeze(-1)

    def response_values(self, policy: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                        num_response_tokens: int, share_prompt: bool = False, pack: bool = False) -> torch.Tensor:
        """`ValueModel.response_values` read from `policy`'s backbone: [B, T] float32, V(state before token t)."""
        return self(response_hidden(policy, sequences, attention_mask, num_response_tokens, share_prompt=share_prompt,
                                    pack=pack))

    def save_pretrained(self, directory: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the head to `value_head.safetensors` in `directory` (the backbone is the policy's, saved with it)."""
        os.makedirs(directory, exist_ok=True)
        state = state_dict if state_dict is not None else self.state_dict()
        save_file({k.removeprefix("value_head."): v.detach().float().cpu().contiguous() for k, v in state.items()},
                  os.path.join(directory, HEAD_FILE))
