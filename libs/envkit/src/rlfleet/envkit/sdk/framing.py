"""How an observation is framed between two assistant turns, so the session's tokens equal what the
chat template renders for the whole conversation.

With the default ChatML template (`rlfleet.common.chat`) every message is
``<|im_start|>role\\ncontent<|im_end|>\\n``. A generated turn normally ends with the model's own
``<|im_end|>`` (an end-of-sequence token of the engine), so the observation must start with the
``\\n`` the template puts after it:

    ...<calc>37*48+5</calc><|im_end|>                  generated (loss mask 1)
    \\n<|im_start|>tool\\n1781<|im_end|>\\n<|im_start|>assistant\\n     observation (mask 0)

A turn cut short (max_new_tokens, a stop string) has no ``<|im_end|>`` yet; then the observation
closes it first (``<|im_end|>\\n...``), as the template would. The observation is sent as text and
tokenized once by the session server; special tokens split the text, so tokenizing this piece alone
gives the same IDs as tokenizing the rendered conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.common.chat import IM_END, render_messages


class TurnFraming(Protocol):
    def learn_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """Sees the rendered prompt's IDs once, at open (to learn the end-of-turn token)."""

    def observation(self, reply: session_pb2.GenerateResponse, content: str,
                    role: str = "tool") -> str | session_pb2.AppendObservationRequest:
        """What to append after `reply`: text that closes the turn if needed, the message and the next
        turn's opening; or a request with chat messages that the session server frames itself."""


class ChatMLFraming:
    """Framing for the default ChatML template."""

    def __init__(self) -> None:
        self.end_of_turn_id: int | None = None

    def learn_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        # <|im_start|> system \n ... <|im_end|> \n <|im_start|> ...: the token two before the second
        # <|im_start|> is <|im_end|>.
        ids = list(prompt_token_ids)
        if not ids:
            return
        try:
            second = ids.index(ids[0], 1)
        except ValueError:
            return
        if second >= 2:
            self.end_of_turn_id = ids[second - 2]

    def turn_closed(self, reply: session_pb2.GenerateResponse) -> bool:
        """Whether the generated turn already ends with the template's end-of-turn token."""
        if self.end_of_turn_id is not None and reply.token_ids:
            return reply.token_ids[-1] == self.end_of_turn_id
        if reply.text.endswith(IM_END):
            return True
        # Without the IDs: no stop strings are set by the SDK, so STOP means an end-of-sequence token.
        return reply.finish_reason == common_pb2.FINISH_REASON_STOP

    def observation(self, reply: session_pb2.GenerateResponse, content: str, role: str = "tool") -> str:
        opener = "\n" if self.turn_closed(reply) else IM_END + "\n"
        return opener + render_messages([{"role": role, "content": content}], add_generation_prompt=True)


class TemplateFraming:
    """Framing by the session server: the observation goes as a chat message and the server renders
    it with the model's own template, closing the turn as that template does (any model family).
    The IDs it was tokenized as come back in `GenerateResponse.observation_token_ids`."""

    def learn_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        pass

    def observation(self, reply: session_pb2.GenerateResponse, content: str,
                    role: str = "tool") -> session_pb2.AppendObservationRequest:
        return session_pb2.AppendObservationRequest(
            messages=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=role, content=content)]),
            add_generation_prompt=True)


def framing_for(name: str):
    """`chatml`: ChatML framed here (the default model); `template`: the model's template, by the server."""
    return {"chatml": ChatMLFraming, "template": TemplateFraming}[name]
