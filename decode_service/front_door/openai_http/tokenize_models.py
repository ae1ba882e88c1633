"""vLLM's `/tokenize` and `/detokenize` bodies as types (strict, as `models`' are).

A prompt is tokenized as the completions route tokenizes it, a chat as the chat route renders it (its
template, generation prompt and tools): the count is the prompt the server would serve. So the options
that would make it another prompt take only the value the generation routes use: special tokens added
to a plain prompt (the tokenizer's own, e.g. BOS) and not to a rendered chat, the generation prompt
added, the last message not continued.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from decode_service.front_door.openai_http.errors import FieldError
from decode_service.front_door.openai_http.models import ChatMessage, Int32, Tool, _Body, _Shape


class TokenizeRequest(_Body):
    """Exactly one of `prompt` (text) and `messages` (a chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: Literal[True] = True
    continue_final_message: Literal[False] = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "prompt or messages is required, and only one of them")
        if self.prompt == "":
            raise FieldError("prompt", "prompt must not be empty")
        chat = self.messages is not None
        if self.add_special_tokens is not None and self.add_special_tokens == chat:
            detail = "false for a chat (its template writes them)" if chat else "true for a prompt"
            raise FieldError("add_special_tokens", f"add_special_tokens must be {detail}, as served")
        if not chat and (self.tools is not None or self.chat_template_kwargs is not None):
            name = "tools" if self.tools is not None else "chat_template_kwargs"
            raise FieldError(name, f"{name} needs messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int32]


class TokenizeResponse(_Shape):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Shape):
    prompt: str
