"""The tokenizer both tiers share: a thin wrapper over a local Hugging Face tokenizer.

It exists so that the rest of tandem sees plain lists of ints and our own exceptions, and so that
the tokenizer's end-of-sequence ids include generation_config.json's, which is where chat models such
as Llama 3 list their extra end-of-turn tokens (the engine adds config.json's `eos_token_id`).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from base.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from engine.chat_keys import control_token_pattern, mark_keys
from engine.token_bytes import TokenBytes

logger = logging.getLogger(__name__)

# Arguments of `apply_chat_template` a request's template kwargs may not override.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
    }
)  # fmt: skip
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _generation_config_eos_ids(directory: Path) -> set[int]:
    """The eos_token_id entry of `directory/generation_config.json` (an int or a list), if any."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(token_id) for token_id in eos}


def _checked_message(index: int, message: object) -> dict[str, Any]:
    """One chat message checked for the fields a template reads; the rest are not passed on."""
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"messages[{index}] must be a mapping with role and content")
    role = message.get("role")
    content = message.get("content")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(f"messages[{index}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
    if not isinstance(content, str):
        raise InvalidRequestError(f"messages[{index}].content must be a string, got {content!r}")
    checked: dict[str, Any] = {"role": role, "content": content}
    tool_calls = message.get("tool_calls")
    if tool_calls:
        if role != "assistant":
            raise InvalidRequestError(f"messages[{index}].tool_calls is only allowed on an assistant turn")
        checked["tool_calls"] = list(tool_calls)
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value:
            if role != "tool":
                raise InvalidRequestError(f"messages[{index}].{key} is only allowed on a tool turn")
            checked[key] = value
    return checked


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and end-of-sequence ids."""

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self._hf = hf_tokenizer
        # The fast tokenizer's Rust decode called directly costs a fraction of
        # `PreTrainedTokenizerFast.decode`, which adds only Python wrapping, unless it post-processes
        # with clean_up_tokenization_spaces; the same holds for its streaming decoder (`decode_stream`).
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(hf_tokenizer, "clean_up_tokenization_spaces", False)
        self._rust_decode = backend.decode if backend is not None and not cleans_up else None
        eos = set(extra_eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        self._eos_token_ids = frozenset(eos)
        # Set by `set_chat_template` (--chat-template); None: the tokenizer's own.
        self._chat_template: str | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer saved in the local directory `path` (tokenizer.json and friends), or the one
        a GGUF file `path` describes in its metadata (`from_gguf`)."""
        directory = Path(path)
        if directory.is_file():
            return cls.from_gguf(directory)
        if not directory.is_dir():
            raise ModelNotFoundError(f"tokenizer directory {directory} does not exist")
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except OSError as exc:
            raise ModelNotFoundError(f"no loadable tokenizer in {directory}: {exc}") from exc
        extra_eos = frozenset(_generation_config_eos_ids(directory))
        tokenizer = cls(hf_tokenizer, extra_eos)
        logger.info(
            "loaded tokenizer from %s: vocab %d, eos ids %s",
            directory,
            tokenizer.vocab_size,
            sorted(tokenizer.eos_token_ids),
        )
        return tokenizer

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        """The tokenizer, end-of-sequence id and chat template in a GGUF's metadata (llama.cpp's
        `tokenizer.ggml.*` and `tokenizer.chat_template`), built by `transformers` as a fast tokenizer."""
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True
            )
        except (OSError, ValueError, KeyError) as exc:
            raise ModelNotFoundError(f"no loadable tokenizer in the GGUF metadata of {path}: {exc}") from exc
        tokenizer = cls(hf_tokenizer)
        logger.info(
            "loaded tokenizer from %s: vocab %d, eos ids %s",
            path,
            tokenizer.vocab_size,
            sorted(tokenizer.eos_token_ids),
        )
        return tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the model's tokenizer adds by default (e.g. BOS)."""
        return list(self._hf(text)["input_ids"])

    def set_chat_template(self, template: str) -> None:
        """Render chats with `template` (Jinja, as in tokenizer_config.json) instead of the model's own.

        Rendered once here on a one-turn chat, so a broken template stops the server at start.
        """
        try:
            self._hf.apply_chat_template(
                [{"role": "user", "content": "hi"}], chat_template=template, tokenize=False
            )
        except TemplateError as exc:
            raise ConfigError(f"the chat template does not render: {exc}") from exc
        self._chat_template = template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        sanitize_control_tokens: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat ending in the assistant's generation prompt.

        Messages are in Hugging Face's chat format: `role` and `content`, plus `tool_calls` on an
        assistant turn (`[{"type": "function", "id": ..., "function": {"name": ..., "arguments": {...}}}]`)
        and `tool_call_id` (and optionally `name`) on a tool turn. `tools` (OpenAI-style function
        entries) are passed to the template, which shows them to the model; a template that knows
        nothing of tools ignores them. `template_kwargs` are more variables for the template (for example
        Qwen3's `enable_thinking`); the caller keeps out the ones this call sets (`RESERVED_TEMPLATE_KWARGS`).

        With `sanitize_control_tokens` (the default) control tokens written anywhere in the messages,
        tools and template kwargs (dict keys included: `engine.chat_keys`) are encoded as plain text, so
        a user cannot close their turn and forge another role's.
        """
        template = self._chat_template or self._hf.chat_template
        if template is None:
            raise InvalidRequestError(
                "this model has no chat template; pass --chat-template (a Jinja file or the template text) "
                "to the server to chat with it, or send a plain prompt (completions)"
            )
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        conversation: object = [_checked_message(index, message) for index, message in enumerate(messages)]
        chat_tools: object = list(tools) if tools else None
        kwargs = dict(template_kwargs or {})
        if sanitize_control_tokens:
            # transformers marks the control tokens of values; keys are client text as well.
            control_tokens = control_token_pattern(self._hf, template)
            conversation = mark_keys(conversation, control_tokens)
            chat_tools = mark_keys(chat_tools, control_tokens)
            kwargs = {name: mark_keys(value, control_tokens) for name, value in kwargs.items()}
        try:
            encoded = self._hf.apply_chat_template(
                conversation,
                **kwargs,
                tools=chat_tools,
                chat_template=template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                sanitize_control_tokens=sanitize_control_tokens,
            )
        except TemplateError as exc:
            # Templates reject some conversations themselves (e.g. roles that do not alternate).
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from exc
        return list(encoded["input_ids"])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; invalid UTF-8 (a character cut between tokens) becomes U+FFFD."""
        if self._rust_decode is not None:
            return self._rust_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(
        self, context: Sequence[int], skip_special_tokens: bool = True
    ) -> Callable[[int], str | None] | None:
        """A step function that turns generated ids, one at a time, into the text each completes (None
        while a character is incomplete or for a skipped special token), with `context` decoded as its
        left context; None when this tokenizer has no Rust decoder to stream with (see `decode`)."""
        if self._rust_decode is None:
            return None
        stream = DecodeStream(list(context), skip_special_tokens)
        return functools.partial(stream.step, self._hf.backend_tokenizer)

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        """`token_bytes(token_id)`: the raw bytes that token adds to the text, a piece of a character
        perhaps (which `decode` of that token alone turns into U+FFFD)."""
        return TokenBytes(self._hf)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a generation unless the request says ignore_eos."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return len(self._hf)

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The wrapped transformers tokenizer, for what this class does not cover."""
        return self._hf
