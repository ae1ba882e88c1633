"""The decode tier: the public Generation gRPC API and OpenAI HTTP API over a continuous batcher.

Two halves: `front_door` (the APIs, checks, tokenization, streams and text) and `engine_core` (the
scheduler, engine loop and prefill); the core never imports the front door. `server` wires them with
`metrics`; `config` and `cli` serve both. Start it with `tandem serve decode` (see
`decode_service.cli`) or in-process with `decode_service.server.DecodeServer`.
"""
