"""The decode tier's front door: everything between a client and the engine core.

The gRPC servicer and the OpenAI-compatible HTTP API, the cheap checks and limits (`admission`,
`request_limits`), validation and tokenization (`validation`, `validation_pool`), grammar compiles
(`constraints`, `grammar_compiler`), the live streams (`streams`, `mailbox`), and the answer's text:
detokenizing, stop strings, reasoning and tool-call parsing (`choice_text`, `answer_parser`).
It knows the served model by its facts (`engine.model_facts.ModelFacts`), never by the engine that holds
the weights and the KV cache.
"""
