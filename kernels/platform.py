"""The kernels one device runs, chosen in one place: `choose_platform` returns a `Platform`.

The attention backend, the linear layers (full precision and quantized), the LM head and the decode-only
decoder stack all follow from the same few facts: the device, the model's dtype, the weight quantization
and the environment switches (`base.settings`). Deciding them together keeps them consistent (one C++
extension or none for all of them) and keeps the engine and the model free of device branches: the
engine builds its model over `Platform.attention`, lets the platform swap the quantized linears, LM
head and embedding in before the checkpoint loads (`quantize_linears`, `quantize_embeddings`) and its CPU
kernels in after (`specialize`), and the model runs whatever it was handed.

On CUDA: Triton attention (torch's when asked), no C++ kernels, `nn.Linear` and the plain LM head (a
quantized layer, the head included, runs its torch reference). On the CPU: the C++ kernels unless
switched off or unbuildable, torch attention over them (Triton's under the interpreter when asked), the
int8 GEMV/GEMM for quantized layers and head, for fp32 models the GEMV/oneDNN linears, the greedy LM
head of narrow models and the decoder stack, and for bf16 models the bf16 GEMV/oneDNN linears with an
fp32-logit LM head, with the attention, cache write and small ops in their bf16 C++ forms (no decoder
stack: it is fp32's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from base.settings import ATTENTION_BACKENDS, Settings, get_settings
from kernels import block_linear, cpu_bf16_linear, cpu_extension, cpu_linear, cpu_lm_head, moe
from kernels.backend import AttentionBackend, TorchBackend
from kernels.w8a8_linear import W8A8Linear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Platform:
    """The kernels chosen for one device, model dtype and weight quantization (`choose_platform`)."""

    device: torch.device
    attention: AttentionBackend
    # The C++ CPU kernels the choices below run on: None on GPUs, when switched off or not buildable.
    extension: ModuleType | None
    # The quantization method's empty module (`engine.quantized_layers.linear_module`) each decoder linear
    # becomes before loading, given `extension`; None: full-precision weights.
    quantized_linear: Callable[[nn.Linear, ModuleType | None], nn.Module] | None
    # The method's empty token-embedding table (`engine.quantized_layers.embedding_module`), given the
    # embedding and, when tied, the quantized LM head whose rows it reads; None: full-precision weights.
    quantized_embedding: Callable[[nn.Embedding, nn.Module | None], nn.Module] | None
    # fp32 linears become `CpuLinear`s: the extension's GEMV for a few rows, oneDNN beyond.
    cpu_linears: bool
    # A narrow fp32 LM head becomes a `CpuLmHead`, whose greedy path never writes the logits.
    cpu_lm_head: bool
    # Decode-only steps (of a few rows with fp32 weights, any size with int8) run every decoder layer in
    # one C++ call (`CpuDecodeStack`).
    decode_stack: bool
    # bf16 linears become `Bf16Linear`s: the extension's bf16 GEMV for a few rows, oneDNN beyond; the LM
    # head's logits fp32 (`kernels.cpu_bf16_linear`).
    bf16_linears: bool = False

    def quantize_linears(self, layers: nn.ModuleList) -> int:
        """Replace every `nn.Linear` inside the decoder `layers` by the quantized module, and their experts
        by the method's quantized experts (`kernels.moe.quantize_experts`); return how many linears.

        Called before the checkpoint is loaded: `CausalLM.load_weights` then quantizes into them.
        """
        if self.quantized_linear is None:
            return 0
        targets = [
            (layer, name, module)
            for layer in layers
            for name, module in layer.named_modules()
            if type(module) is nn.Linear
        ]
        for layer, name, module in targets:
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, self.quantized_linear(module, self.extension))
        experts = moe.quantize_experts(layers, self.quantized_linear, self.extension)
        logger.info(
            "decoder linear layers load quantized",
            extra={"count": len(targets), "experts": experts, "cpu_kernels": self.extension is not None},
        )
        return len(targets)

    def quantize_embeddings(self, model: nn.Module) -> bool:
        """Replace a `CausalLM`'s LM head by the quantized linear module and its token embedding by the
        method's quantized table, which, when the two are tied, reads the head's rows: one quantized copy
        of the matrix. Called before the checkpoint is loaded, as `quantize_linears` is; True when done.

        The head then runs the method's kernels (on the CPU the int8 GEMV/GEMM; elsewhere its torch
        reference), never the fp32 `CpuLmHead` nor a `CpuLinear`, which leave non-`nn.Linear` heads alone.
        """
        if self.quantized_linear is None or self.quantized_embedding is None:
            return False
        tied = model.lm_head.weight is model.embed_tokens.weight
        head = self.quantized_linear(model.lm_head, self.extension)
        model.embed_tokens = self.quantized_embedding(model.embed_tokens, head if tied else None)
        model.lm_head = head
        logger.info(
            "LM head and embedding load quantized",
            extra={"tied": tied, "vocab": head.out_features, "cpu_kernels": self.extension is not None},
        )
        return True

    def specialize(self, model: nn.Module) -> None:
        """Hand a loaded `engine.models.decoder.CausalLM` this platform's CPU kernels: its LM head (first,
        so the linear swap leaves it alone) and its greedy path, its other fp32 linears, its decoder stack."""
        if self.cpu_lm_head and cpu_lm_head.use_cpu_lm_head(model, self.extension):
            model.greedy_head = model.lm_head.greedy
        if self.cpu_linears:
            cpu_linear.use_cpu_linears(model, self.extension)
        if self.bf16_linears:
            cpu_bf16_linear.use_bf16_linears(model, self.extension)
        if self.extension is not None:
            moe.use_cpu_kernels(model, self.extension)
            block_linear.use_cpu_kernels(model, self.extension)
        # The stack computes the dense families' layers with fp32 activations: a mixture of experts and
        # W8A8 linears keep the per-op path.
        if self.decode_stack and len(model.layers) > 0 and model.fits_decode_stack and not w8a8(model):
            model.decode_stack = model.build_decode_stack(self.extension)
            logger.info("decode-only steps run the C++ decoder stack", extra={"layers": len(model.layers)})


def w8a8(model: nn.Module) -> bool:
    """Whether `model`'s linears quantize their activations (`kernels.w8a8_linear`)."""
    return any(isinstance(module, W8A8Linear) for module in model.modules())


def _attention(device: torch.device, choice: str, extension: ModuleType | None) -> AttentionBackend:
    """The backend `choice` (auto, torch or triton) names; auto is Triton on CUDA and torch elsewhere."""
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        # Imported here: a CPU process that never asks for Triton never imports it.
        from kernels.triton_backend import TritonBackend

        return TritonBackend()
    return TorchBackend(extension)


def choose_platform(
    device: torch.device | str,
    dtype: torch.dtype,
    quantized_linear: Callable[[nn.Linear, ModuleType | None], nn.Module] | None = None,
    attention_backend: str | None = None,
    settings: Settings | None = None,
    quantized_embedding: Callable[[nn.Embedding, nn.Module | None], nn.Module] | None = None,
) -> Platform:
    """The kernels for a model of `dtype` on `device`, its decoder linears and LM head built as
    `quantized_linear` and its embedding as `quantized_embedding` (None: full precision).
    `attention_backend` overrides `TANDEM_ATTENTION_BACKEND`; `settings` defaults to the environment's now."""
    device = torch.device(device)
    settings = get_settings() if settings is None else settings
    backend = (attention_backend or settings.attention_backend).lower()
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"the attention backend must be auto, torch or triton, not {backend!r}")
    on_cpu = device.type == "cpu"
    # The C++ kernels serve only CPU tensors: on a GPU, building them is a compile for nothing.
    extension = cpu_extension.load() if on_cpu and settings.cpu_extension else None
    fp32_on_cpu = on_cpu and dtype == torch.float32
    platform = Platform(
        device=device,
        attention=_attention(device, backend, extension),
        extension=extension,
        quantized_linear=quantized_linear,
        quantized_embedding=quantized_embedding,
        cpu_linears=fp32_on_cpu and settings.onednn_linear and cpu_linear.available(),
        cpu_lm_head=fp32_on_cpu and settings.onednn_linear and extension is not None,
        decode_stack=fp32_on_cpu and settings.cpu_decode_stack and extension is not None,
        bf16_linears=on_cpu and dtype == torch.bfloat16 and settings.onednn_linear and extension is not None,
    )
    logger.info(
        "kernels chosen",
        extra={
            "device": str(device),
            "backend": platform.attention.name,
            "cpu_kernels": extension is not None,
            "cpu_linears": platform.cpu_linears,
            "cpu_lm_head": platform.cpu_lm_head,
            "decode_stack": platform.decode_stack,
            "bf16_linears": platform.bf16_linears,
        },
    )
    return platform
