"""What `--chat-template` names: a Jinja file, or (as vLLM's flag also takes) the template text itself.

A base model such as Gemma 3 270M ships no chat template, so its chat endpoints refuse requests until
the operator supplies one; writing it inline saves a file in a container spec. A value that names an
existing file is read; one that holds Jinja syntax is the template; anything else is a mistake the
server refuses at start, rather than rendering a path as a literal prompt prefix.
"""

from __future__ import annotations

from pathlib import Path

from base.errors import ConfigError

# A template without any of these would render the same text for every chat: it cannot be one.
_JINJA_MARKERS = ("{{", "{%")


def read_chat_template(value: str) -> str:
    """The Jinja source `value` stands for: the contents of the file it names, or `value` itself when it
    is inline Jinja. Raises ConfigError when it is neither (a mistyped path, an unreadable file)."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):
        # An inline template can be longer than a file name may be, or hold a NUL byte.
        is_file = False
    if is_file:
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the chat template {path}: {exc}") from None
    if any(marker in value for marker in _JINJA_MARKERS):
        return value
    raise ConfigError(
        f"chat template {value!r} is not a readable file, nor an inline Jinja template (no '{{{{' or '{{%')"
    )
