"""`--quantization int8` in the engine and on the command line: greedy output equals Hugging Face running
the dequantized weights (q * scale) token for token, the decoder layers' linears, the LM head and the
embedding are quantized (one int8 copy when the last two are tied), the C++ decoder stack computes what
the per-layer path computes, and bad values or combinations are refused before the model loads."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from conftest import engine_for, hf_greedy, random_prompts, save_tiny_model, tiny_hf_model
from test_cpu_decode_stack import forward_both_ways
from torch import nn

from base.errors import ConfigError
from base.settings import CPU_EXTENSION_ENV, Settings
from engine import quantization, quantized_layers
from engine.config import EngineConfig
from engine.engine import GenerateRequest, kv_namespace
from engine.model_runner import ScheduledChunk
from engine.params import SamplingParams, StoppingParams
from kernels import cpu_extension, int8_linear
from kernels.int8_embedding import Int8Embedding
from kernels.int8_linear import Int8Linear, dequantize, quantize_per_channel
from kernels.platform import choose_platform

GREEDY = SamplingParams(temperature=0.0)
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantized_hf(hf: nn.Module) -> nn.Module:
    """A copy of an HF model whose decoder-layer linears, embedding and LM head hold q * scale: what int8
    serving must equal (a tied head is the embedding's weight, so it is dequantized once, with it)."""
    reference = copy.deepcopy(hf)
    for layer in reference.model.layers:
        for name, module in layer.named_modules():
            if name.rpartition(".")[2] in DECODER_LINEARS:
                module.weight.data = dequantize(*quantize_per_channel(module.weight))
    for table in {id(m.weight): m for m in (reference.get_input_embeddings(), reference.lm_head)}.values():
        table.weight.data = dequantize(*quantize_per_channel(table.weight))
    return reference


@pytest.mark.parametrize(
    ("kind", "heads", "kv_heads", "head_dim", "seed", "budget"),
    [("llama", 4, 2, 64, 11, 64), ("qwen2", 4, 2, 64, 12, 37), ("llama", 6, 1, 80, 13, 100)],
)
def test_int8_greedy_equals_hf_on_dequantized_weights(kind, heads, kv_heads, head_dim, seed, budget):
    """Mixed batches: prefill chunks beyond the GEMV's rows (the GEMM) beside decode steps of up to eight
    sequences (the GEMV, in the C++ decoder stack); with qkv bias and tied embeddings (qwen2)."""
    hf = tiny_hf_model(seed, kind=kind, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    reference = dequantized_hf(hf)
    prompts = random_prompts(10, seed, min_len=2, max_len=90)
    max_new = [6 + (i * 5) % 11 for i in range(len(prompts))]
    engine = engine_for(hf, num_blocks=160, shuffle_seed=seed, quantization="int8")
    requests = [
        GenerateRequest(p, GREEDY, StoppingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, max_new, strict=True)
    ]
    seqs = engine.generate(requests, max_num_batched_tokens=budget, max_num_seqs=8)
    for prompt, n, seq in zip(prompts, max_new, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(reference, prompt, n), f"prompt of {len(prompt)} tokens"
    assert engine.block_manager.num_free_blocks == 160


def test_the_decoder_linears_are_quantized_per_row():
    hf = tiny_hf_model(14, kind="qwen2")
    engine = engine_for(hf, quantization="int8")
    model = engine.model
    for layer in model.layers:
        linears = [
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ]
        assert all(isinstance(linear, Int8Linear) for linear in linears)
        assert all(linear.qweight.dtype == torch.int8 for linear in linears)
        assert layer.self_attn.qkv_proj.bias.dtype == torch.float32, "the qkv bias stays as it was"
    fused = model.layers[0].mlp.gate_up_proj
    gate = hf.model.layers[0].mlp.gate_proj.weight
    expected_q, expected_scale = quantize_per_channel(gate)
    assert torch.equal(fused.qweight[: gate.shape[0]], expected_q), "per-row: fusing changes nothing"
    assert torch.equal(fused.scale[: gate.shape[0]], expected_scale)


def vocab_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every distinct tensor (by storage) the model holds with a row per vocabulary entry."""
    vocab, seen = model.config.vocab_size, {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.dim() >= 1 and tensor.shape[0] == vocab:
            seen.setdefault((tensor.untyped_storage().data_ptr(), tensor.dtype), tensor)
    return list(seen.values())


def test_a_tied_head_and_embedding_hold_one_int8_copy():
    """qwen2's tiny config ties them: the head is int8 through the int8 kernels, the lookup reads the same
    int8 rows, and no full-precision copy of the matrix is left in the model."""
    hf = tiny_hf_model(19, kind="qwen2")
    model = engine_for(hf, quantization="int8").model
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.embed_tokens, Int8Embedding)
    assert (
        model.embed_tokens.qweight is model.lm_head.qweight
        and model.embed_tokens.scale is model.lm_head.scale
    )
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    held = sorted((t.numel(), t.dtype) for t in vocab_tensors(model))
    assert held == [(vocab, torch.float32), (vocab * hidden, torch.int8)], "one int8 matrix, no fp32 copy"
    expected_q, expected_scale = quantize_per_channel(hf.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.qweight, expected_q) and torch.equal(model.lm_head.scale, expected_scale)
    ids = torch.tensor([0, 5, vocab - 1, 5])
    assert torch.equal(model.embed_tokens(ids), dequantize(expected_q, expected_scale)[ids])
    hidden_states = torch.randn(3, hidden)
    torch.testing.assert_close(
        model.compute_logits(hidden_states), hidden_states @ dequantize(expected_q, expected_scale).T
    )


def test_an_untied_head_and_embedding_are_quantized_each_from_its_own_weight():
    hf = tiny_hf_model(20, kind="llama")
    model = engine_for(hf, quantization="int8").model
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.embed_tokens, Int8Embedding)
    assert model.embed_tokens.qweight.data_ptr() != model.lm_head.qweight.data_ptr()
    for ours, theirs in ((model.lm_head, hf.lm_head), (model.embed_tokens, hf.model.embed_tokens)):
        expected_q, expected_scale = quantize_per_channel(theirs.weight)
        assert torch.equal(ours.qweight, expected_q) and torch.equal(ours.scale, expected_scale)
    assert all(t.dtype != torch.float32 or t.dim() == 1 for t in vocab_tensors(model)), "no fp32 matrix"


def test_int8_greedy_equals_hf_on_the_torch_reference_path(monkeypatch):
    """Without the C++ kernels the int8 head and linears run their torch reference, the path a GPU takes."""
    monkeypatch.setenv(CPU_EXTENSION_ENV, "0")
    hf = tiny_hf_model(21, kind="qwen2")
    engine = engine_for(hf, num_blocks=64, device="cpu", quantization="int8")
    assert engine.platform.extension is None and isinstance(engine.model.lm_head, Int8Linear)
    reference = dequantized_hf(hf)
    prompts = random_prompts(3, 21, min_len=2, max_len=40)
    stopping = StoppingParams(max_tokens=6, ignore_eos=True)
    seqs = engine.generate([GenerateRequest(p, GREEDY, stopping) for p in prompts])
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(reference, prompt, 6)


class TiedPair(nn.Module):
    """The two modules `Platform.quantize_embeddings` replaces, tied as `CausalLM` ties them."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden, dtype=dtype)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        self.lm_head.weight = self.embed_tokens.weight


def test_a_gpu_platform_quantizes_a_bf16_head_and_embedding_for_its_torch_reference(monkeypatch):
    """No GPU needed: a CUDA platform builds the same one-copy pair with no C++ kernels; the lookup returns
    the model's dtype and the head computes the dequantized product (here on CPU tensors)."""
    monkeypatch.setattr(cpu_extension, "load", lambda: pytest.fail("no C++ CPU kernels on a GPU"))
    platform = choose_platform(
        "cuda",
        torch.bfloat16,
        quantized_layers.linear_module("int8"),
        quantized_embedding=quantized_layers.embedding_module("int8"),
        settings=Settings(),
    )
    pair = TiedPair(50, 24, torch.bfloat16)
    weight = torch.randn(50, 24)
    assert platform.quantize_embeddings(pair)
    pair.embed_tokens.load_weight_rows(0, weight)
    assert pair.lm_head._extension is None and pair.embed_tokens.qweight is pair.lm_head.qweight
    dequantized = dequantize(*quantize_per_channel(weight)).to(torch.bfloat16)
    ids = torch.tensor([[3, 49], [0, 3]])
    looked_up = pair.embed_tokens(ids)
    assert looked_up.dtype == torch.bfloat16 and looked_up.shape == (2, 2, 24)
    assert torch.equal(looked_up, dequantized[ids])
    x = torch.randn(4, 24, dtype=torch.bfloat16)
    assert torch.equal(pair.lm_head(x), nn.functional.linear(x, dequantized))


def test_unquantized_engines_are_untouched():
    engine = engine_for(tiny_hf_model(15))
    assert not any(isinstance(m, Int8Linear | Int8Embedding) for m in engine.model.modules())
    assert engine.platform.quantized_linear is None
    assert engine.platform.quantize_linears(engine.model.layers) == 0
    assert not engine.platform.quantize_embeddings(engine.model)


def test_decoder_stack_equals_the_per_layer_path_with_int8_weights(extension):
    """Decode steps of 1 to GEMV_MAX_ROWS sequences and beyond: the C++ stack runs the int8 GEMV or GEMM
    the layers run at that row count, bit for bit."""
    engine = engine_for(tiny_hf_model(16), num_blocks=200, device="cpu", quantization="int8")
    assert engine.model.decode_stack is not None
    seqs = []
    for prompt in random_prompts(int8_linear.GEMV_MAX_ROWS + 5, 16, min_len=3, max_len=40):
        seq = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=8))
        engine.allocate(seq, seq.num_tokens + 8)
        engine.step([ScheduledChunk(seq, seq.num_tokens)])
        seqs.append(seq)
    for batch in (seqs[:1], seqs[:5], seqs[: int8_linear.GEMV_MAX_ROWS], seqs):
        chunks = [ScheduledChunk(seq, 1) for seq in batch]
        metadata = engine.runner.prepare(chunks)[2]
        assert engine.model.decode_stack.accepts(torch.empty(len(batch), 1), metadata)
        fused, per_layer = forward_both_ways(engine, chunks)
        assert torch.equal(fused, per_layer)
        engine.step(chunks)


def test_quantized_kv_is_cached_apart():
    hf = tiny_hf_model(17)
    plain, int8 = engine_for(hf), engine_for(hf, quantization="int8")
    args = (plain.model_config, torch.float32, 16)
    assert kv_namespace(*args) == kv_namespace(*args, weight_quantization="none")
    assert kv_namespace(*args, weight_quantization="int8") != kv_namespace(*args)
    assert plain.block_manager.namespace != int8.block_manager.namespace


def test_weights_fingerprint_marks_quantized_weights_only():
    assert quantization.weights_fingerprint("abc", "none") == "abc"
    assert quantization.weights_fingerprint("abc", "int8") == "abc+int8-weights-and-embedding", (
        "int8 replicas from before the embedding was quantized announced +int8-weights: they must differ"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": "int4"}, "unknown quantization 'int4'; choose one of none, int8"),
        (
            {"quantization": "int8", "dtype": torch.bfloat16},
            "--quantization int8 on the CPU runs fp32 activations; use --dtype float32, not bfloat16",
        ),
    ],
)
def test_engine_config_refuses_what_cannot_run(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(device="cpu", **kwargs)


def test_int8_with_bf16_is_allowed_on_gpus():
    EngineConfig(device="cuda", dtype=torch.bfloat16, quantization="int8")


@pytest.mark.parametrize("tier", ["decode", "prefill"])
def test_flags_reach_the_engine_config_and_bad_values_stop_the_parser(tier, capsys):
    from serving.flags import engine_config_from_args
    from tandem.cli import build_parser

    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve", tier])).quantization == "none"
    int8 = parser.parse_args(["serve", tier, "--quantization", "int8"])
    assert engine_config_from_args(int8).quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", tier, "--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    both = parser.parse_args(["serve", tier, "--quantization", "int8", "--dtype", "float16"])
    with pytest.raises(ConfigError, match="use --dtype float32, not float16"):
        engine_config_from_args(both)


def test_a_tier_with_a_bad_combination_exits_before_loading_the_model(tmp_path):
    save_tiny_model(tmp_path, 18)
    command = [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "prefill",
        "--model",
        str(tmp_path),
        "--port",
        "0",
    ]
    done = subprocess.run(
        [*command, "--quantization", "int8", "--dtype", "bfloat16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "--quantization int8 on the CPU runs fp32 activations" in done.stderr
    assert "loaded" not in done.stderr, "the model was loaded before the flags were checked"


def test_every_command_offers_the_registry_methods():
    """The flags list their choices literally (no torch import for `--help`); they must match."""
    from tandem.cli import build_parser

    parser = build_parser()
    for argv in (["serve", "decode"], ["serve", "prefill"], ["up"]):
        command = parser.parse_args(argv)
        assert command.quantization in (None, "none")
    subcommands = parser._subparsers._group_actions[0].choices
    commands = [subcommands["serve"]._subparsers._group_actions[0].choices[t] for t in ("decode", "prefill")]
    for command in [*commands, subcommands["up"]]:
        (action,) = [a for a in command._actions if a.dest == "quantization"]
        assert tuple(action.choices) == quantization.CHOICES


def test_tandem_up_passes_the_quantization_to_both_tiers():
    from pathlib import Path

    from tandem.cli import build_parser
    from tandem.up import tier_specs

    args = build_parser().parse_args(["up", "--quantization", "int8"])
    for spec in tier_specs(args, Path("/models/m")):
        assert spec.argv[spec.argv.index("--quantization") + 1] == "int8"
    default = build_parser().parse_args(["up"])
    assert all("--quantization" not in spec.argv for spec in tier_specs(default, Path("/m")))


def test_every_method_names_its_layers():
    assert set(quantized_layers.LAYERS) == set(quantization.METHODS)
    assert quantized_layers.linear_module(quantization.NONE) is None
