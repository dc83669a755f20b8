"""A chat environment's episode as the policy's chat template writes it (`lmrl.rollout.multiturn`).

An environment whose observations are chat messages continues the episode's tokens: each observation is rendered as
the template continues a conversation and appended after the model's turn as it was sampled. A reasoning model's
template writes an earlier turn otherwise: Qwen3's and DeepSeek-R1's cut its reasoning (`<think>...</think>`). The
model is deployed with that template, so it should learn in the contexts the template makes. `ChatHistory` keeps the
episode's messages; after each turn and its observation it tells whether the template still writes every turn of the
current sample as it was sent (the episode goes on as one sample) or not: then the episode's tokens so far close as a
training sample and the next turn starts from the conversation as the template writes it
(`lmrl.rollout.samples`), the turns it keeps as they were sampled (`lmrl.rollout.chat_turns.render_conversation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmrl.models.prompt_encoding import encode_text
from lmrl.rollout.chat_turns import Reply, render_conversation, turn_end


class ChatHistory:
    """One episode's conversation: its prompt's messages, then each model turn and observation."""

    def __init__(self, tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any = None) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.messages = [dict(m) for m in messages]
        self.replies: list[Reply] = []
        self.since = 0  # the first reply of the current sample

    def add(self, turn_ids: list[int], text: str, observation: Sequence[dict[str, Any]]) -> list[int] | None:
        """After a model turn (its ids and text) and the observation's messages: None where the template writes every
        turn of the current sample as it was sent (the observation continues the sample); else the token ids of the
        conversation as the template writes it, ending with the generation prompt: the next sample's context."""
        reply = {"role": "assistant", "content": text}
        raw = self.tokenizer.decode(turn_ids, skip_special_tokens=False)
        self.replies.append(Reply(reply, raw, turn_end(self.tokenizer, turn_ids)))
        self.messages += [reply, *observation]
        plain = self.tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True,
                                                   tools=self.tools or None)
        if all(r.message["content"] in plain for r in self.replies[self.since:]):
            return None
        self.since = len(self.replies)
        return encode_text(self.tokenizer, render_conversation(self.tokenizer, self.messages, self.tools, self.replies)[0])
