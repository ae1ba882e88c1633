"""The OpenAI-compatible HTTP API of the decode tier: the same requests and deltas as the gRPC API.

`models` types the OpenAI request bodies, `protocol` turns them into `GenerateRequest`s, `responses`
turns the stream's `GenerateResponse`s into OpenAI bodies and SSE chunks, `errors` maps failures to
OpenAI error bodies, and `app` serves it all with FastAPI on the decode server's own event loop.
Beside it, Anthropic's Messages API (`anthropic_models`, `anthropic_protocol`, `anthropic_responses`,
`anthropic_routes`) and vLLM's tokenizer routes (`tokenize_models`, `tokenize_routes`); `request_io`
is what every route does first (key, body limits, disconnects).
"""
