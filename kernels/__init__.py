"""Attention and fused ops for tandem: torch reference/CPU implementations, Triton kernels for GPUs,
and one chooser (`kernels.platform.choose_platform`) that picks them for the engine's device.

This package shares its import name with the unrelated Hugging Face `kernels` hub package;
`tests/test_kernels_shadowing.py` proves `transformers` does not mistake it for that one.
"""
