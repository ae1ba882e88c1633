"""Control tokens in the dict keys of a chat's inputs, encoded as the plain text they spell.

`transformers`' `apply_chat_template(..., sanitize_control_tokens=True)` wraps every control token found
in the chat's strings in private markers, so that only the control tokens the template writes itself are
encoded as tokens, and a user cannot close their turn and forge another role's. It marks dict values, not
dict keys. Keys are client text too, and templates render them: Qwen2.5's writes each tool as JSON
(`tool | tojson`: the parameters' property names) and each replayed tool call's arguments as JSON (their
keys). A property name of 40 `<|im_start|>` then cost 39 prompt tokens where the same text as message
content cost 360: control tokens, forged turns.

`mark_keys` marks every key, at any depth, exactly as transformers marks values (the same markers, the
same control tokens: those of the tokenizer and the template), before the chat reaches it; transformers
then marks the values and encodes both alike. It relies on transformers' own marking helpers so that the
two can never disagree on what a marker or a control token is.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import mark_control_tokens


def control_token_pattern(tokenizer: PreTrainedTokenizerBase, template: str) -> re.Pattern[str]:
    """The regex transformers marks the control tokens of `template` over `tokenizer` with."""
    control_tokens = tokenizer._get_control_tokens(template)
    longest_first = sorted(control_tokens, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")


def mark_keys(obj: object, control_tokens: re.Pattern[str]) -> object:
    """`obj` (JSON-like: dicts, lists, strings, numbers) with the control tokens of every dict key, at any
    depth, wrapped in transformers' markers (a marker already in a key is dropped, as in a value). Values
    are returned as they are, for transformers to mark."""
    if isinstance(obj, dict):
        return {
            _marked_key(key, control_tokens): mark_keys(value, control_tokens) for key, value in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [mark_keys(item, control_tokens) for item in obj]
    return obj


def _marked_key(key: object, control_tokens: re.Pattern[str]) -> object:
    # The markers are outside ASCII: an ASCII key without a control token stays as it is (most keys; a
    # search costs a fraction of transformers' marking).
    if isinstance(key, str) and (not key.isascii() or control_tokens.search(key)):
        return mark_control_tokens(key, control_tokens)
    return key
