"""The decode tier's engine core: what runs the model step after step.

The continuous (or static) scheduler and its policies, the engine loop thread, and prefill (local, or
remote from a prefill tier with its KV writes). Inside, it knows requests as `request.ServedRequest`
and answers with `request.StreamDelta`s; at its boundary (`core.EngineCore.apply`) the front door sends it
`messages.Submit` and reads `messages.StepOut`, whether the core runs on a thread of the server
(`in_process`) or in a process of its own (`core_client`, `core.run_core`). It never imports the front
door (`decode_service.front_door`).
"""
