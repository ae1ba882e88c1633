"""The decode tier's front door: everything between a client and the engine core.

The gRPC servicer and the OpenAI-compatible HTTP API, the cheap checks and limits (`admission`),
validation and tokenization off the event loop (`validation`), constraint parsing (`constraints`), the
live streams (`streams`), and the answer's text: detokenizing, stop strings, reasoning and tool-call
parsing (`choice_text`). It knows the served model by its facts (`engine.model_facts.ModelFacts`),
never by the engine that holds the weights and the KV cache.
"""
