"""The tiny tokenizer tests build their models with; it lives in `tandem.tiny_model` so that
`tandem selftest` can serve a tiny model from an installed package."""

from tandem.tiny_model import (  # noqa: F401
    CHATML_TEMPLATE,
    ENDOFTEXT,
    ENDOFTEXT_ID,
    IM_END,
    IM_END_ID,
    IM_START,
    IM_START_ID,
    SPECIAL_TOKENS,
    TINY_EOS_TOKEN_IDS,
    TINY_VOCAB_SIZE,
    build_tiny_tokenizer,
)
