"""Weight quantization methods, by the name `--quantization` takes: what each quantizes, where it can
run, and the mark it leaves on the weights' fingerprint. Which module (and so which kernel) runs a
method's layers is `engine.quantized_layers`: this module loads no kernel, so a config can be checked
where no model is built (the decode front door).

The linear layers of the decoder layers (q/k/v/o and gate/up/down, fused or not), the LM head and the
token embedding are quantized; norms and biases keep the model's dtype. The head is the method's linear
module; the embedding is the method's table of the same rows, and when the two are tied it reads the
head's quantized rows, so one quantized copy of the matrix is held (for a 262k vocabulary that matrix
is most of the model: Gemma 3 270M). Logits stay fp32. Quantization happens at load: the engine swaps
the empty model's linears, head and embedding for the method's modules before the checkpoint streams
in, and each checkpoint tensor is quantized as it arrives, a block of rows at a time (`load_weight_rows`,
`engine.models.decoder.row_blocks`), so the full-precision weights never live in the model and an int8
load peaks at the int8 model plus about one checkpoint tensor (tests/test_streamed_load.py).

The default model's GGUF (what `tandem fetch-model` gets) stores the decoder linears as Q4_1 (blocks
of 32 weights, each with its own scale and minimum) and the embedding as Q8_0 (blocks of 32, own
scale): neither maps onto one symmetric scale per row, so int8 is quantized from the checkpoint the
fetch caches (the GGUF dequantized once, as for fp32).

A method joins by adding a `QuantizationMethod` to `METHODS` and its modules to
`engine.quantized_layers.LAYERS` (fp8 on GPUs through `torch._scaled_mm` would be the next).

Quantized weights are other weights: KV computed with them differs from full precision, so the method
is part of the model identity both tiers compare before any KV moves (`weights_fingerprint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from base.errors import ConfigError

NONE = "none"


@dataclass(frozen=True)
class QuantizationMethod:
    """One weight quantization method."""

    name: str
    # Raises ConfigError, naming the flags, when the method cannot run on this device and dtype.
    check: Callable[[torch.device, torch.dtype], None]
    # What `weights_fingerprint` appends: it names what the method quantizes, so replicas that quantize
    # different parts (and so compute different KV) never exchange it.
    fingerprint_mark: str
    # What it appends instead where the method kept a GGUF's Q8_0 blocks as stored (see METHODS); None:
    # the method never keeps them.
    q8_0_fingerprint_mark: str | None = None


def _fp32_on_cpu(name: str) -> Callable[[torch.device, torch.dtype], None]:
    def check(device: torch.device, dtype: torch.dtype) -> None:
        if device.type == "cpu" and dtype != torch.float32:
            raise ConfigError(
                f"--quantization {name} on the CPU runs fp32 activations; use --dtype float32, not "
                f"{str(dtype).removeprefix('torch.')}"
            )

    return check


METHODS: dict[str, QuantizationMethod] = {
    # Before the embedding was quantized too, int8 replicas announced "+int8-weights".
    "int8": QuantizationMethod("int8", _fp32_on_cpu("int8"), "int8-weights-and-embedding"),
    # int8 weights as above, with each token's activations quantized to int8 before every linear and the
    # LM head (`kernels.w8a8_linear`); the embedding lookup is int8's. A GGUF's Q8_0 linears keep their
    # blocks (already int8 weights, a scale per 32) and quantize activations per block of 32 as llama.cpp
    # does (`kernels.q8_0_w8a8`), where int8 requantizes them per row like any other weight.
    "w8a8_int8": QuantizationMethod(
        "w8a8_int8",
        _fp32_on_cpu("w8a8_int8"),
        "w8a8-int8-weights-activations-and-embedding",
        "w8a8-q8_0-blocks-int8-activations-per-32-and-int8-embedding",
    ),
}
CHOICES = (NONE, *METHODS)


def check_supported(name: str, device: str | torch.device, dtype: torch.dtype) -> None:
    """Raise ConfigError unless `name` is a known method that runs on `device` with `dtype`."""
    if name == NONE:
        return
    if name not in METHODS:
        raise ConfigError(f"unknown quantization {name!r}; choose one of {', '.join(CHOICES)}")
    METHODS[name].check(torch.device(device), dtype)


def weights_fingerprint(model_fingerprint: str, name: str, keeps_blocks: bool = False) -> str:
    """The fingerprint a tier announces for its weights: the checkpoint's, marked with the quantization.

    Unquantized weights keep the checkpoint's fingerprint as it was, so replicas of earlier versions
    still agree with them. `keeps_blocks`: the model computes a GGUF's blocks as stored; under a method
    that then computes them its own way (w8a8_int8's per-block activations against Q8_0 blocks) the mark
    says so, so such a tier never exchanges KV with one that requantized the same file per row.
    """
    if name == NONE:
        return model_fingerprint
    method = METHODS[name]
    mark = (
        method.q8_0_fingerprint_mark
        if keeps_blocks and method.q8_0_fingerprint_mark
        else method.fingerprint_mark
    )
    return f"{model_fingerprint}+{mark}"
