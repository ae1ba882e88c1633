"""The decode tier: the public Generation gRPC API, the continuous batcher, its policies and preemption.

Start it with `tandem serve decode` (see `decode_service.cli`) or in-process with
`decode_service.server.DecodeServer`.
"""
