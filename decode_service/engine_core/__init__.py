"""The decode tier's engine core: what runs the model step after step.

The continuous (or static) scheduler and its policies, the engine loop thread, the stream-interval
buffer on its deliveries, and prefill (local, or remote from a prefill tier with its KV writes). It
knows requests as `request.ServedRequest` and answers with `request.StreamDelta`s; it never imports
the front door (`decode_service.front_door`), so it can move to a process of its own.
"""
