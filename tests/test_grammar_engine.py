"""Grammar-constrained sampling in the engine: every sampling path obeys the mask, only constrained rows
pay for it, and the grammar decides when the output ends."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
import torch
import xgrammar as xgr
from conftest import engine_for, hf_greedy, random_prompts, tiny_hf_model
from test_decode_scheduler import Harness
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.engine_core.request import ServedRequest, StreamDelta
from engine.engine import GenerateRequest
from engine.grammar import GrammarDeadEndError, GrammarState, GrammarViolationError, control_free_tokens
from engine.params import SamplingParams, StoppingParams
from engine.sequence import FinishReason
from engine.tokenizer import Tokenizer
from serving.status import status_for

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "b"]},
    },
    "required": ["name", "size", "kind"],
    "additionalProperties": False,
}
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def info(tokenizer) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf, vocab_size=TINY_VOCAB_SIZE, stop_token_ids=list(TINY_EOS_TOKEN_IDS)
    )


@pytest.fixture(scope="module")
def compiler(info) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(info, max_threads=1)


@pytest.fixture(scope="module")
def json_safe(info) -> torch.Tensor:
    return control_free_tokens(info)


@pytest.fixture(scope="module")
def schema_grammar(compiler) -> xgr.CompiledGrammar:
    return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(5, vocab_size=TINY_VOCAB_SIZE)


def run(engine, prompts, sampling, grammar=None, max_tokens=60, allowed=None, **stopping):
    requests = [
        GenerateRequest(
            prompt,
            sampling,
            StoppingParams(max_tokens=max_tokens, **stopping),
            grammar=GrammarState(grammar, allowed_tokens=allowed) if grammar is not None else None,
        )
        for prompt in prompts
    ]
    return engine.generate(requests, max_num_seqs=8)


@pytest.mark.parametrize(
    "sampling",
    [
        GREEDY,
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=2),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(
            temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3, seed=1
        ),
        SamplingParams(temperature=0.0, logit_bias={ord("{"): -100.0}),
    ],
    ids=["greedy", "seeded", "top-p-k", "logprobs", "penalties", "bias-against-grammar"],
)
def test_every_sampling_path_gives_schema_valid_json(
    hf_model, tokenizer, schema_grammar, json_safe, sampling
):
    engine = engine_for(hf_model, tokenizer=tokenizer)
    prompts = random_prompts(6, 3, vocab=TINY_VOCAB_SIZE)
    seqs = run(engine, prompts, sampling, schema_grammar, max_tokens=120, allowed=json_safe)
    for seq in seqs:
        assert seq.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(tokenizer.decode(seq.output_token_ids)), SCHEMA)
    assert engine.num_free_blocks == engine.num_blocks


def test_ignore_eos_and_min_tokens_still_end_when_the_grammar_completes(hf_model, tokenizer, compiler):
    engine = engine_for(hf_model, tokenizer=tokenizer)
    grammar = compiler.compile_regex("(yes|no)")
    [seq] = run(engine, [[5, 6, 7]], GREEDY, grammar, max_tokens=30, ignore_eos=True, min_tokens=10)
    assert tokenizer.decode(seq.output_token_ids) in ("yes", "no")
    assert seq.finish_reason is FinishReason.STOP
    assert seq.output_token_ids[-1] in TINY_EOS_TOKEN_IDS


def test_max_tokens_cuts_a_grammar_with_length(hf_model, tokenizer, compiler):
    engine = engine_for(hf_model, tokenizer=tokenizer)
    grammar = compiler.compile_regex("[a-z]{40}")
    [seq] = run(engine, [[5, 6, 7]], GREEDY, grammar, max_tokens=5)
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.num_output_tokens == 5
    assert all(c.isalpha() and c.islower() for c in tokenizer.decode(seq.output_token_ids))


def test_greedy_rows_beside_a_constrained_one_keep_their_tokens(
    hf_model, tokenizer, schema_grammar, json_safe
):
    prompts = random_prompts(5, 9, min_len=4, max_len=30, vocab=TINY_VOCAB_SIZE)
    engine = engine_for(hf_model, tokenizer=tokenizer)
    requests = [GenerateRequest(p, GREEDY, StoppingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    grammar = GrammarState(schema_grammar, None, json_safe)
    requests.append(GenerateRequest([9, 10, 11], GREEDY, StoppingParams(max_tokens=60), grammar=grammar))
    seqs = engine.generate(requests, max_num_seqs=8)
    for prompt, seq in zip(prompts, seqs, strict=False):
        assert seq.output_token_ids == hf_greedy(hf_model, prompt, 12)
    jsonschema.validate(json.loads(tokenizer.decode(seqs[-1].output_token_ids)), SCHEMA)


def test_grammar_waits_for_its_activating_token(hf_model, tokenizer, compiler):
    engine = engine_for(hf_model, tokenizer=tokenizer)
    free = engine.generate([GenerateRequest([5, 6], GREEDY, StoppingParams(max_tokens=6, ignore_eos=True))])
    trigger = free[0].output_token_ids[2]  # the model writes this token freely at its third step
    grammar = GrammarState(compiler.compile_regex("(yes|no)"), activate_after=trigger)
    [seq] = engine.generate([GenerateRequest([5, 6], GREEDY, StoppingParams(max_tokens=30), grammar=grammar)])
    assert seq.output_token_ids[:3] == free[0].output_token_ids[:3]
    assert tokenizer.decode(seq.output_token_ids[3:-1]) in ("yes", "no")
    assert seq.finish_reason is FinishReason.STOP


def test_a_token_the_grammar_forbids_is_refused(compiler):
    state = GrammarState(compiler.compile_regex("a"))
    with pytest.raises(GrammarViolationError):
        state.accept(ord("z") % TINY_VOCAB_SIZE)


@pytest.mark.parametrize(
    "impossible",
    [
        ("grammar", 'root ::= root "a"'),  # a rule with no base case: nothing is allowed at all
        (
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {"q": {"type": "string", "pattern": "^\\n$"}},
                    "required": ["q"],
                }
            ),
        ),
    ],
    ids=["no-base-case", "pattern-the-control-mask-empties"],
)
def test_a_grammar_that_allows_no_token_ends_its_request_alone(
    hf_model, tokenizer, compiler, json_safe, impossible
):
    engine = engine_for(hf_model, tokenizer=tokenizer)
    harness = Harness(engine)
    for i, prompt in enumerate(random_prompts(3, 11, min_len=3, max_len=9, vocab=TINY_VOCAB_SIZE)):
        harness.submit(f"free-{i}", prompt, max_tokens=16)
    kind, spec = impossible
    compiled = (
        compiler.compile_grammar(spec)
        if kind == "grammar"
        else compiler.compile_json_schema(spec, any_whitespace=False)
    )
    stopping = StoppingParams(max_tokens=16)
    seq = engine.make_sequence(
        [5, 6, 7], GREEDY, stopping, "bad", grammar=GrammarState(compiled, None, json_safe)
    )
    harness.loop.submit(ServedRequest(seq))
    harness.run()
    error = harness.errors.pop("bad")
    assert isinstance(error, GrammarDeadEndError)
    code, message = status_for(error)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "allows no token at this point" in message
    assert not harness.errors, harness.errors
    for i in range(3):
        assert harness.finish[f"free-{i}"] is FinishReason.LENGTH and len(harness.tokens[f"free-{i}"]) == 16
    assert engine.num_free_blocks == engine.num_blocks


def test_forked_choices_start_their_grammar_from_the_beginning(
    hf_model, tokenizer, schema_grammar, json_safe
):
    engine = engine_for(hf_model, tokenizer=tokenizer)
    harness = Harness(engine)
    per_choice: dict[int, list[int]] = {}
    finish: dict[int, FinishReason] = {}
    deliver = harness.loop._deliver

    def by_choice(deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            per_choice.setdefault(delta.request.index, []).extend(delta.token_ids)
            if delta.finish_reason is not None:
                finish[delta.request.index] = delta.finish_reason
        deliver(deltas)

    harness.loop._deliver = by_choice
    sampling = SamplingParams(temperature=1.0, seed=3)
    grammar = GrammarState(schema_grammar, None, json_safe)
    seq = engine.make_sequence([4, 5, 6], sampling, StoppingParams(max_tokens=120), "r", grammar=grammar)
    harness.loop.submit(ServedRequest(seq, n=3))
    harness.run()
    assert sorted(finish) == [0, 1, 2]
    texts = set()
    for index in range(3):
        assert finish[index] is FinishReason.STOP
        text = tokenizer.decode(per_choice[index])
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 1, "seeded choices sample differently"
    assert engine.num_free_blocks == engine.num_blocks


def test_preempted_constrained_requests_resume_their_grammar(hf_model, tokenizer, schema_grammar, json_safe):
    engine = engine_for(
        hf_model, tokenizer=tokenizer, block_size=8, num_blocks=32, max_num_seqs=8, max_num_batched_tokens=64
    )
    harness = Harness(engine)
    prompts = random_prompts(8, 4, min_len=10, max_len=20, vocab=TINY_VOCAB_SIZE)
    for i, prompt in enumerate(prompts):
        stopping = StoppingParams(max_tokens=100)
        seq = engine.make_sequence(
            prompt, GREEDY, stopping, f"r{i}", grammar=GrammarState(schema_grammar, None, json_safe)
        )
        harness.loop.submit(ServedRequest(seq))
    harness.run()
    assert harness.scheduler.num_preemptions > 0
    assert not harness.errors, harness.errors
    finished = [i for i in range(len(prompts)) if harness.finish[f"r{i}"] is FinishReason.STOP]
    assert len(finished) == len(prompts), "every answer completes its grammar within max_tokens"
    for i in finished:
        jsonschema.validate(json.loads(tokenizer.decode(harness.tokens[f"r{i}"])), SCHEMA)
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("jump_forward", [True, False])
def test_forced_text_is_appended_without_a_forward_per_token(hf_model, tokenizer, compiler, jump_forward):
    engine = engine_for(hf_model, tokenizer=tokenizer, grammar_jump_forward=jump_forward)
    steps = []
    step = engine.step
    engine.step = lambda chunks: steps.append([c.num_tokens for c in chunks]) or step(chunks)
    grammar = GrammarState(compiler.compile_regex(r'\{"answer": "(yes|no)", "confidence": [0-9]\}'))
    [seq] = engine.generate(
        [GenerateRequest([5, 6, 7], GREEDY, StoppingParams(max_tokens=60), grammar=grammar)]
    )
    text = tokenizer.decode(seq.output_token_ids)
    assert re.fullmatch(r'\{"answer": "(yes|no)", "confidence": [0-9]\}', text)
    assert seq.finish_reason is FinishReason.STOP
    forwards_after_prefill = len(steps) - 1
    if jump_forward:
        assert forwards_after_prefill < seq.num_output_tokens // 2
        assert any(tokens > 1 for chunks in steps[1:] for tokens in chunks)
    else:
        assert forwards_after_prefill == seq.num_output_tokens - 1


def test_forced_text_respects_max_tokens_and_logprob_requests(hf_model, tokenizer, compiler):
    engine = engine_for(hf_model, tokenizer=tokenizer, grammar_jump_forward=True)
    grammar = compiler.compile_regex("a(bcdefghij)")
    [cut] = engine.generate(
        [GenerateRequest([5, 6], GREEDY, StoppingParams(max_tokens=3), grammar=GrammarState(grammar))]
    )
    assert cut.num_output_tokens == 3 and cut.finish_reason is FinishReason.LENGTH
    with_logprobs = SamplingParams(temperature=0.0, logprobs=1)
    [seq] = engine.generate(
        [GenerateRequest([5, 6], with_logprobs, StoppingParams(max_tokens=30), grammar=GrammarState(grammar))]
    )
    assert tokenizer.decode(seq.output_token_ids) == "abcdefghij"
