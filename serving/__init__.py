"""The serving shell both tiers share: engine thread, live-call registry, gRPC server lifecycle, flags.

It imports `base`, the engine, `kv_transfer` and the protos, never a tier: `decode_service` and
`prefill_service` build on it.
"""
