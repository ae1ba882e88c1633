"""Limits on what one public request may ask for, checked before any expensive work.

Each check takes plain values, so both front doors (gRPC and HTTP) call the same functions, and each
refusal names the server flag that sets the limit, so a client knows what to ask its operator for.
The checks are cheap by design: they run on the event loop, before a request takes a slot and before
its prompt is tokenized (tokenizing costs ~300 bytes of memory per prompt byte).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from base.errors import ConfigError, InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds; the defaults suit the default model and are raised by flags.

    `max_id_bytes` bounds request ids and tenant names (printable text only: they are echoed in every
    stream message and written to logs). `max_prompt_bytes` bounds a text or chat prompt's UTF-8 size
    before it is tokenized. `max_stop_strings` and `max_stop_string_length` (characters) bound the
    stop-string matcher, which runs on the engine thread for every token. `max_logit_bias` bounds a
    request's logit bias entries, checked before any is converted (each costs Python time on the way in
    and a scatter on every step). `max_chat_messages` bounds a chat's turns before any is converted or
    rendered: the chat template costs GIL-held Python per turn, however short. `max_json_objects`
    bounds an HTTP body's JSON objects while it is parsed: each costs a dict built under the GIL, and
    a body of 110k tiny turns held the event loop 40-100 ms before any field was looked at. A non-streamed
    HTTP answer is built whole in memory, so `max_unstreamed_tokens` bounds what it may hold: choices
    x max_tokens x (1 + alternatives per token), ~300 bytes each.
    """

    max_id_bytes: int = 1024
    max_prompt_bytes: int = 1024 * 1024
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    max_logit_bias: int = 1024
    max_chat_messages: int = 2048
    max_json_objects: int = 16384
    max_unstreamed_tokens: int = 64 * 4096

    def validate(self) -> None:
        for name in (
            "max_id_bytes",
            "max_prompt_bytes",
            "max_stop_strings",
            "max_stop_string_length",
            "max_logit_bias",
            "max_chat_messages",
            "max_json_objects",
            "max_unstreamed_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    def check_id(self, field: str, value: str) -> None:
        """An identifier the server echoes and logs: printable, and at most `max_id_bytes` of UTF-8."""
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > self.max_id_bytes:
            raise InvalidRequestError(
                f"{field} is {size} bytes, above this server's limit of {self.max_id_bytes} (--max-id-bytes)"
            )
        if not value.isprintable():
            raise InvalidRequestError(f"{field} must be printable text (no newlines or control characters)")

    def check_prompt_bytes(self, size: int) -> None:
        if size > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"the prompt is {size} bytes, above this server's limit of {self.max_prompt_bytes} "
                "(--max-prompt-bytes)"
            )

    def check_stop(self, stop: Sequence[str]) -> None:
        if len(stop) > self.max_stop_strings:
            raise InvalidRequestError(
                f"stop has {len(stop)} strings, above this server's limit of {self.max_stop_strings} "
                "(--max-stop-strings)"
            )
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_string_length:
            raise InvalidRequestError(
                f"a stop string has {longest} characters, above this server's limit of "
                f"{self.max_stop_string_length} (--max-stop-string-length)"
            )

    def check_logit_bias(self, count: int) -> None:
        if count > self.max_logit_bias:
            raise InvalidRequestError(
                f"logit_bias has {count} entries, above this server's limit of {self.max_logit_bias} "
                "(--max-logit-bias)"
            )

    def check_chat_messages(self, count: int) -> None:
        if count > self.max_chat_messages:
            raise InvalidRequestError(
                f"messages has {count} turns, above this server's limit of {self.max_chat_messages} "
                "(--max-chat-messages)"
            )

    def check_json_objects(self, count: int) -> None:
        """Called as an HTTP body's objects are parsed, so a refusal costs `max_json_objects` of them."""
        if count > self.max_json_objects:
            raise InvalidRequestError(
                f"the request body holds more than {self.max_json_objects} JSON objects, this server's "
                "limit (--max-json-objects)"
            )

    def check_unstreamed(self, choices: int, max_tokens: int, alternatives: int) -> None:
        """A whole (non-streamed) answer's worst case, from what the request asks for."""
        worst = choices * max_tokens * (1 + alternatives)
        if worst > self.max_unstreamed_tokens:
            raise InvalidRequestError(
                f"a non-streamed answer of n={choices} x max_tokens={max_tokens} x (1 + {alternatives} "
                f"logprobs) may hold {worst} tokens, above this server's limit of "
                f"{self.max_unstreamed_tokens} (--max-unstreamed-tokens); stream it (stream: true), "
                "or lower n, max_tokens or logprobs"
            )
