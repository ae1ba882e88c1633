"""The prefill tier: chunked prefill on its own gRPC service, streaming each prompt's KV blocks.

Start it with `tandem serve prefill` (see `prefill_service.cli`) or in-process with
`prefill_service.server.PrefillServer`. Only the decode tier calls it (`tandem.internal.v1.Prefill`).
"""
