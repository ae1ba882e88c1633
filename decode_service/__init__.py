"""The decode tier: the public Generation gRPC API and OpenAI HTTP API over a continuous batcher.

Two halves: `front_door` (the APIs, checks, tokenization, streams and text) and `engine_core` (the
scheduler, engine loop and prefill); the core never imports the front door. `server` wires them with
`metrics`; `config` and `cli` serve both. Start it with `tandem serve decode` (see
`decode_service.cli`) or in-process with `decode_service.server.DecodeServer`.

One `Generate`, in the order its code runs:

1. `front_door.servicer` takes the RPC; `front_door.generation.Generations.start` checks the cheap
   limits (`front_door.admission`), reserves a stream (`front_door.streams`), and has
   `front_door.validation` tokenize and check the request off the event loop, which makes an
   `engine_core.messages.Submit`.
2. `engine_core.core_client` sends it down the pipe; in the core process `engine_core.core.run_core`
   reads it and `engine_core.core.EngineCore.apply` makes it an `engine_core.request.ServedRequest`.
3. `engine_core.engine_loop` steps: `engine_core.scheduler` (with `engine_core.policies`) picks the
   batch, `engine.engine` runs it (`engine.block_manager`, `engine.model_runner`,
   `engine.models.decoder`, `engine.sampler`, the `kernels`).
4. Each step's `StepOut` goes back through the core's `StepWriter`; `server` hands it to `metrics` and
   the streams, `front_door.choice_text` turns tokens into text (detokenizer, stop strings, parsers),
   and the servicer writes the responses.

`tandem bench request-files` lists every file this touches, in both processes.
"""
