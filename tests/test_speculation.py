"""N-gram speculative decoding (`engine.speculation`): the lookup, and the engine's output with drafts.

Greedy output must equal Hugging Face token for token with speculation on (every family, sliding
windows, prefix cache, int8 weights); seeded sampling must give the same tokens as without it; and
unseeded sampling at temperature 0.8 must follow the target distribution (a chi-square test against
the exact probabilities). Each test also checks that drafts were made and both kept and refused, so
it exercises verification rather than plain decoding.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
import xgrammar as xgr
from conftest import TINY_VOCAB, engine_for, hf_greedy, save_tiny_model, tiny_hf_model, wait_until
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_decode_scheduler import Harness
from test_disagg_serving import RunningDecode, RunningPrefill, tokens_of
from test_model_families import hf_model, reference
from test_quantization import dequantized_hf
from tiny_tokenizer import TINY_VOCAB_SIZE

from base.errors import ConfigError, InvalidRequestError
from engine.engine import GenerateRequest
from engine.grammar import GrammarState
from engine.params import SamplingParams, StoppingParams
from engine.sampler import Sampler
from engine.speculation import NgramDrafts, SpeculationStats, SpeculativeConfig
from protos.tandem.v1 import generation_pb2 as pb

# Drafts whenever the context has a match (no extra row is counted as a cost), so tests verify many.
NGRAM = SpeculativeConfig(method="ngram", row_cost=0.0, prompt_lookup_min=1)
GREEDY = SamplingParams(temperature=0.0)


def copying_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a span of themselves, so their continuations find n-gram matches."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        body = torch.randint(0, TINY_VOCAB, (12 + 7 * i,), generator=gen).tolist()
        prompts.append(body + body[: 5 + i] + body[3:9])
    return prompts


def generate(engine, prompts, max_tokens, sampling=GREEDY, **kwargs) -> list[list[int]]:
    stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = engine.generate([GenerateRequest(p, sampling, stopping) for p in prompts], **kwargs)
    return [seq.output_token_ids for seq in seqs]


def assert_verified_both_ways(stats: SpeculationStats) -> None:
    """Drafts were made, some of their tokens kept and some refused."""
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# -- the lookup ---------------------------------------------------------------------------------------


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    drafts = NgramDrafts(SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3))
    # "7 8" occurs twice; the 3-gram "6 7 8" only once (followed by 1 2); the longest match wins.
    tokens = [6, 7, 8, 1, 2, 5, 7, 8, 3, 4, 6, 7, 8]
    assert drafts.propose(tokens, 4) == [1, 2, 5, 7]
    tokens += [9, 7, 8]  # now the longest earlier match is "7 8" at its latest place, before 9
    assert drafts.propose(tokens, 3) == [9, 7, 8]
    assert drafts.propose(tokens, 1) == [9]


def test_no_draft_without_an_earlier_occurrence_and_never_from_the_suffix_itself() -> None:
    drafts = NgramDrafts(SpeculativeConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=2))
    assert drafts.propose([1, 2, 3, 4], 4) == []
    assert drafts.propose([5], 4) == []
    assert drafts.propose([1, 2, 1, 2], 4) == [1, 2]


def test_draft_length_follows_acceptance_and_batch_size() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, row_cost=0.27, probe_steps=3)
    drafts = NgramDrafts(config)
    drafts.acceptance = 0.9
    assert drafts.draft_length(1) == 3
    # 0.9 ** j against 16 * 0.27 / (1 + 0.27 * 15) = 0.855: one token pays, not two.
    assert drafts.draft_length(16) == 1
    for _ in range(6):
        drafts.record(1, 0)
    assert drafts.acceptance < config.row_cost
    assert [drafts.draft_length(1) for _ in range(6)] == [0, 0, 1, 0, 0, 1]  # a probe every third step
    drafts.record(3, 3)  # kept tokens raise the estimate, the refused one after them lowers it
    assert drafts.acceptance > 0.27


def test_stats_count_acceptance_per_position() -> None:
    stats = SpeculationStats()
    stats.record(3, 2)
    stats.record(4, 0)
    stats.record(2, 1)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 3)
    assert stats.accepted_per_position == [2, 1, 0, 0]


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"method": "eagle"}, "--speculative"),
        ({"num_speculative_tokens": 0}, "--num-speculative-tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "--prompt-lookup-min"),
        ({"disable_by_batch_size": 0}, "--speculative-disable-by-batch-size"),
    ],
)
def test_bad_configuration_names_the_flag(kwargs, flag) -> None:
    with pytest.raises(ConfigError, match=flag):
        SpeculativeConfig(**kwargs)


def test_disable_speculation_must_be_a_bool() -> None:
    with pytest.raises(InvalidRequestError, match="disable_speculation must be a bool"):
        SamplingParams(disable_speculation="yes").validate()


# -- the engine ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_cache", "prefix_cache"])
def test_greedy_output_is_unchanged_and_equals_hf(prefix_caching: bool) -> None:
    hf = tiny_hf_model(0)
    prompts = copying_prompts(6, seed=1)
    max_tokens = 40
    engine = engine_for(hf, shuffle_seed=2, enable_prefix_caching=prefix_caching, speculative=NGRAM)
    # Two waves: the second repeats the prompts, so with the cache on it starts from cached blocks that
    # speculated steps committed.
    for _ in range(2):
        outputs = generate(engine, prompts, max_tokens, max_num_batched_tokens=40, max_num_seqs=4)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output == hf_greedy(hf, prompt, max_tokens), f"prompt of {len(prompt)} diverged"
    assert_verified_both_ways(engine.speculation_stats)
    assert (engine.block_manager.num_hit_tokens > 0) == prefix_caching
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_window", "mistral_window", "qwen2"])
def test_families_with_windows_equal_hf_with_speculation(name: str) -> None:
    """Sliding windows: drafts' queries read their windows, and blocks slide out after verification."""
    engine = engine_for(hf_model(name), block_size=8, num_blocks=96, shuffle_seed=3, speculative=NGRAM)
    prompts = [p[:40] for p in copying_prompts(4, seed=5)]
    max_new = 24
    outputs = generate(engine, prompts, max_new, max_num_batched_tokens=23, max_num_seqs=4)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == reference(name, tuple(prompt), max_new), f"{name}: prompt of {len(prompt)} diverged"
    assert engine.speculation_stats.num_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == 96


def test_int8_weights_and_int8_kv_keep_greedy_output() -> None:
    hf = tiny_hf_model(4)
    prompts = copying_prompts(4, seed=6)
    max_tokens = 30
    kwargs = dict(quantization="int8", kv_cache_dtype="int8")
    plain = generate(engine_for(hf, **kwargs), prompts, max_tokens)
    engine = engine_for(hf, speculative=NGRAM, **kwargs)
    assert generate(engine, prompts, max_tokens) == plain
    assert_verified_both_ways(engine.speculation_stats)
    reference_model = dequantized_hf(hf)
    assert generate(engine_for(hf, speculative=NGRAM, quantization="int8"), prompts[:2], max_tokens) == [
        hf_greedy(reference_model, p, max_tokens) for p in prompts[:2]
    ]


def test_penalties_and_min_tokens_are_those_of_plain_decoding() -> None:
    """Rows after a draft see the draft in their history: penalties and min_tokens' suppression of stop
    tokens are what plain decoding computes at the same place."""
    hf = tiny_hf_model(5)
    prompts = copying_prompts(3, seed=7)
    sampling = SamplingParams(temperature=0.0, repetition_penalty=1.02, frequency_penalty=0.05)
    stopping = StoppingParams(max_tokens=30, min_tokens=20, stop_token_ids=(5, 9, 11))
    requests = [GenerateRequest(p, sampling, stopping) for p in prompts]
    plain = engine_for(hf).generate(requests)
    engine = engine_for(hf, speculative=NGRAM)
    fast = engine.generate(requests)
    assert [s.output_token_ids for s in fast] == [s.output_token_ids for s in plain]
    assert [s.finish_reason for s in fast] == [s.finish_reason for s in plain]
    assert engine.speculation_stats.num_accepted_tokens > 0


def test_seeded_sampling_draws_the_same_tokens_with_and_without_speculation() -> None:
    hf = tiny_hf_model(6)
    prompts = copying_prompts(5, seed=8)
    sampling = SamplingParams(temperature=0.8, top_k=40, seed=1234)
    plain = generate(engine_for(hf), prompts, 40, sampling)
    engine = engine_for(hf, speculative=NGRAM)
    assert generate(engine, prompts, 40, sampling) == plain
    assert_verified_both_ways(engine.speculation_stats)


def test_opted_out_requests_and_constrained_ones_never_draft() -> None:
    hf = tiny_hf_model(0)
    engine = engine_for(hf, speculative=NGRAM)
    opted_out = SamplingParams(temperature=0.0, disable_speculation=True)
    generate(engine, copying_prompts(3, seed=1), 20, opted_out)
    assert engine.speculation_stats.num_drafts == 0
    prompt = copying_prompts(1, seed=1)[0]
    stopping = StoppingParams(max_tokens=8)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([f"t{i}" for i in range(TINY_VOCAB)]))
    constrained = engine.make_sequence(
        prompt, GREEDY, stopping, grammar=GrammarState(compiler.compile_regex("[ab]+"))
    )
    assert engine.propose_draft(constrained, 3) == ()
    assert engine.propose_draft(engine.make_sequence(prompt, GREEDY, stopping), 3) != ()
    generate(engine, copying_prompts(3, seed=1), 20)
    assert engine.speculation_stats.num_drafts > 0


def test_the_scheduler_drafts_only_up_to_the_batch_size_limit() -> None:
    hf = tiny_hf_model(0)
    config = replace(NGRAM, disable_by_batch_size=2)
    prompts = copying_prompts(4, seed=3)
    # One step prefills all four (no cap), so they decode together from the first step to the last.
    crowded = Harness(engine_for(hf, speculative=config), max_prefills_per_step=0)
    for i, prompt in enumerate(prompts):
        crowded.submit(f"r{i}", prompt, 12)
    crowded.run()
    assert crowded.engine.speculation_stats.num_drafts == 0
    alone = Harness(engine_for(hf, speculative=config))
    alone.submit("r0", prompts[0], 12)
    alone.run()
    assert alone.engine.speculation_stats.num_drafts > 0
    for harness in (crowded, alone):
        for rid, tokens in harness.tokens.items():
            assert tokens == hf_greedy(hf, prompts[int(rid[1:])], 12)


def test_drafts_stop_at_max_tokens() -> None:
    hf = tiny_hf_model(0)
    engine = engine_for(hf, speculative=NGRAM)
    outputs = generate(engine, copying_prompts(4, seed=1), 7)
    assert [len(o) for o in outputs] == [7] * 4
    assert engine.speculation_stats.num_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _exact_joint(hf, prompt: list[int], sampling: SamplingParams, depth: int) -> dict[tuple[int, ...], float]:
    """The target's probability of every continuation of `depth` tokens under temperature and top-k."""

    def next_probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1].double() / sampling.temperature
        kth = logits.topk(sampling.top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)

    joint = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for prefix, p in joint.items():
            probs = next_probs(prompt + list(prefix))
            for token in probs.nonzero().flatten().tolist():
                grown[(*prefix, token)] = p * float(probs[token])
        joint = grown
    return joint


def test_sampled_continuations_follow_the_target_distribution() -> None:
    """3,000 unseeded samples of 3 tokens at temperature 0.8 (top-k 3, so 27 outcomes) against the
    exact joint probabilities: a chi-square test at the 0.1% level. The prompt is the model's own
    sampled text, so the drafts its n-grams give are often, not always, what the model samples."""
    hf = tiny_hf_model(7)
    sampling = SamplingParams(temperature=0.8, top_k=3)
    torch.manual_seed(0)
    with torch.no_grad():
        text = hf.generate(
            torch.tensor([[1, 2, 3]]),
            do_sample=True,
            temperature=0.8,
            top_k=3,
            max_new_tokens=300,
            pad_token_id=0,
        )
    prompt = text[0].tolist()
    engine = engine_for(hf, num_blocks=1024, speculative=NGRAM)
    engine.sampler = Sampler(seed=99)
    samples = 3000
    outputs = generate(engine, [prompt] * samples, 3, sampling, max_num_seqs=64, max_num_batched_tokens=512)
    assert_verified_both_ways(engine.speculation_stats)
    joint = _exact_joint(hf, prompt, sampling, 3)
    counts = {outcome: 0 for outcome in joint}
    for output in outputs:
        counts[tuple(output)] += 1
    statistic = sum((counts[o] - samples * p) ** 2 / (samples * p) for o, p in joint.items())
    # chi-square with 26 degrees of freedom: P(X > 54.05) = 0.001
    assert statistic < 54.05, f"chi-square {statistic:.1f}: {counts}"
    # The samples spread over the outcomes (a sampler stuck on one continuation would fail here too).
    assert sum(1 for count in counts.values() if count > 0) >= 10


# -- served -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-speculation-model")
    return directory, save_tiny_model(directory, 43)


def hf_logprobs(hf, prompt: list[int], output: list[int]) -> list[float]:
    """The reference log-probability of each output token after what precedes it."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return (
        torch.log_softmax(logits.double(), dim=-1)
        .gather(1, torch.tensor(output).unsqueeze(1))
        .flatten()
        .tolist()
    )


def scrape(server: RunningDecode) -> dict[tuple[str, tuple], float]:
    text = generate_latest(server.server.metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_served_speculation_keeps_tokens_and_logprobs_aggregated_and_disaggregated(served_model):
    """Both topologies draft on the decode tier from prompt and output; tokens equal Hugging Face's,
    each token has its own logprob, both choices of an n = 2 request decode alike, the vLLM counters move,
    and an opted-out request drafts nothing."""
    model_dir, hf = served_model
    gen = torch.Generator().manual_seed(9)
    prompts = []
    for length in (20, 34, 70):
        body = torch.randint(3, TINY_VOCAB_SIZE, (length,), generator=gen).tolist()
        prompts.append(body + body[: length // 2])
    max_tokens = 30
    prefill = RunningPrefill(model_dir)
    servers = {
        "disaggregated": RunningDecode(model_dir, prefill=prefill.address, speculative=NGRAM),
        "aggregated": RunningDecode(model_dir, speculative=NGRAM),
    }
    try:
        for topology, server in servers.items():
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                futures = [
                    pool.submit(server.generate, p, max_tokens, f"{topology}-{i}", logprobs=2)
                    for i, p in enumerate(prompts)
                ]
                responses = [future.result(180) for future in futures]
            for prompt, response in zip(prompts, responses, strict=True):
                tokens = tokens_of(response)
                assert tokens == hf_greedy(hf, prompt, max_tokens), (
                    f"{topology}: prompt of {len(prompt)} diverged"
                )
                logprobs = [lp for r in response for lp in r.logprobs]
                assert [lp.token_id for lp in logprobs] == tokens
                assert [lp.logprob for lp in logprobs] == pytest.approx(
                    hf_logprobs(hf, prompt, tokens), abs=1e-4
                )
            samples = scrape(server)
            drafts = samples[("vllm:spec_decode_num_drafts_total", ())]
            accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", ())]
            assert drafts > 0 and 0 < accepted < samples[("vllm:spec_decode_num_draft_tokens_total", ())]
            assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] > 0
            opted_out = server.generate(prompts[0], max_tokens, f"{topology}-out", disable_speculation=True)
            assert tokens_of(opted_out) == hf_greedy(hf, prompts[0], max_tokens)
            assert scrape(server)[("vllm:spec_decode_num_drafts_total", ())] == drafts
            two = pb.GenerateRequest(
                request_id=f"{topology}-n2",
                token_ids=prompts[1],
                n=2,
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
            )
            choices = [[], []]
            for response in server.stub.Generate(two, timeout=120):
                choices[response.index].extend(response.token_ids)
            assert choices == [hf_greedy(hf, prompts[1], max_tokens)] * 2
            assert wait_until(server.pool_is_full)
        assert prefill.prefilled_request_ids() >= {f"disaggregated-{i}" for i in range(len(prompts))}
    finally:
        for server in servers.values():
            server.close()
        prefill.close()
