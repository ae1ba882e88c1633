"""Attention and fused ops for tandem: torch reference/CPU implementations, Triton kernels for GPUs,
and one dispatch point (`kernels.backend.get_backend`) that the engine calls.

This package shares its import name with the unrelated Hugging Face `kernels` hub package;
`tests/test_kernels_shadowing.py` proves `transformers` does not mistake it for that one.
"""
