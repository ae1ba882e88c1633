"""The bottom layer: what every other package needs and that needs none of them.

Errors, structured logging, transport auth and the KV cache's element dtypes live here so that kernels,
the engine, the serving shell, both tiers and the client can share them without importing upward (see
tests/test_layering.py).
"""
