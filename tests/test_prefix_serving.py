"""Prefix caching through the real servers: a multi-turn chat with history resent is greedy-identical with
the cache on and off (aggregated and disaggregated) and equal to Hugging Face, disaggregated decode sends
only the blocks it lacks, prefill refuses a held prefix it cannot vouch for, three prefill replicas keep a
prefix on one replica, salts isolate, and every pool is idle (no reference left) after each test."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import hf_greedy, save_tiny_model, wait_until
from test_disagg_serving import BLOCK_SIZE, RunningDecode, RunningPrefill, prompts_of
from tiny_tokenizer import TINY_VOCAB_SIZE

from engine.block_manager import chain_hash, root_hash
from engine.engine import kv_namespace
from protos.tandem.internal.v1 import prefill_pb2, prefill_pb2_grpc
from protos.tandem.v1 import generation_pb2 as pb


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama saved with the tiny tokenizer; returns (directory, the HF reference model)."""
    directory = tmp_path_factory.mktemp("tiny-prefix-model")
    return directory, save_tiny_model(directory, 34)


def chat(decode: RunningDecode, system: list[int], users: list[list[list[int]]], reply_len: int):
    """Conversations one after another, each turn resending the history; returns replies, final messages."""
    replies, finals = [], []
    for c, turns in enumerate(users):
        history = list(system)
        for t, user in enumerate(turns):
            history += user
            responses = decode.generate(history, reply_len, f"c{c}-t{t}")
            reply = [token for r in responses for token in r.token_ids]
            replies.append(reply)
            finals.append(responses[-1])
            history += reply
    return replies, finals


def chat_workload(seed: int) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(70)]
    users = [[[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(9)] for _ in range(3)] for _ in range(2)]
    return system, users


def hf_chat(hf, system, users, reply_len):
    expected = []
    for turns in users:
        history = list(system)
        for user in turns:
            history += user
            expected.append(hf_greedy(hf, history, reply_len))
            history += expected[-1]
    return expected


def test_disaggregated_multi_turn_is_exact_and_sends_only_what_decode_lacks(model):
    model_dir, hf = model
    system, users = chat_workload(1)
    runs = {}
    for caching in (False, True):
        prefill = RunningPrefill(model_dir, prefix_caching=caching)
        decode = RunningDecode(model_dir, prefill=prefill.address, prefix_caching=caching)
        try:
            replies, finals = chat(decode, system, users, 5)
            runs[caching] = (replies, finals, decode.stats.kv_bytes_received, decode.stats.kv_blocks_skipped)
            assert decode.stats.remote_prefills_completed == 6, "every turn went to the prefill tier"
            assert wait_until(decode.pool_is_full) and wait_until(prefill.pool_is_full)
        finally:
            decode.close()
            prefill.close()
    (off_replies, _, off_bytes, off_skipped), (on_replies, on_finals, on_bytes, on_skipped) = (
        runs[False],
        runs[True],
    )
    assert on_replies == off_replies == hf_chat(hf, system, users, 5)
    assert off_skipped == 0 and on_skipped > 0
    assert on_bytes < off_bytes / 2, "later turns send only their new blocks"
    assert all(f.usage.cached_tokens > 0 for f in on_finals[1:]), "later turns hit prefill's own cache"


def test_aggregated_multi_turn_is_exact_and_reports_cached_tokens(model):
    model_dir, hf = model
    system, users = chat_workload(2)
    decode = RunningDecode(model_dir)
    try:
        replies, finals = chat(decode, system, users, 4)
        cached = [f.usage.cached_tokens for f in finals]
        assert replies == hf_chat(hf, system, users, 4)
        assert cached[0] == 0 and all(c > 0 and c % BLOCK_SIZE == 0 for c in cached[1:])
        assert cached[3] == 64, "the second conversation's first turn shares the system prompt's full blocks"
        assert wait_until(decode.pool_is_full)
    finally:
        decode.close()


def test_cache_salts_isolate_and_bad_salts_are_refused(model):
    model_dir, _ = model
    decode = RunningDecode(model_dir, cache_salt_by_tenant=True)
    try:
        prompt = prompts_of([50], seed=5)[0]
        assert decode.generate(prompt, 2, "a1", salt="a")[-1].usage.cached_tokens == 0
        assert decode.generate(prompt, 2, "b1", salt="b")[-1].usage.cached_tokens == 0
        assert decode.generate(prompt, 2, "a2", salt="a")[-1].usage.cached_tokens == 48
        other_tenant = pb.GenerateRequest(
            token_ids=prompt, cache_salt="a", tenant="t2", stopping=pb.StoppingParams(max_tokens=2)
        )
        assert list(decode.stub.Generate(other_tenant, timeout=60))[-1].usage.cached_tokens == 0
        with pytest.raises(grpc.RpcError) as refused:
            decode.generate(prompt, 2, "long-salt", salt="x" * 1025)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "cache_salt is 1025 bytes, above this server's limit of 1024" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            decode.generate(prompt, 2, "control-salt", salt="a\nb")
        assert "cache_salt must be printable" in refused.value.details()
        assert decode.generate(prompt, 2, "a3", salt="a")[-1].usage.cached_tokens == 48, "still serving"
        assert decode.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).prefix_caching
        assert wait_until(decode.pool_is_full)
    finally:
        decode.close()
    off = RunningDecode(model_dir, prefix_caching=False)
    try:
        assert not off.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).prefix_caching
    finally:
        off.close()


def held_request(
    prefill: RunningPrefill, prompt: list[int], held: int, **overrides
) -> prefill_pb2.PrefillRequest:
    """A Prefill call claiming `held` leading blocks, with their true chain hash unless overridden."""
    engine = prefill.engine
    digest = root_hash(kv_namespace(engine.model_config, engine.dtype, BLOCK_SIZE), "")
    for i in range(held):
        digest = chain_hash(digest, prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
    fields = {
        "request_id": "held",
        "prompt_token_ids": prompt,
        "sampling": pb.SamplingParams(temperature=0.0),
        "compatibility_hash": prefill.server.compatibility_hash,
        "num_held_blocks": held,
        "held_prefix_hash": digest if held else b"",
        **overrides,
    }
    return prefill_pb2.PrefillRequest(**fields)


def test_prefill_sends_only_blocks_after_the_held_ones_and_refuses_a_held_prefix_it_cannot_vouch_for(model):
    model_dir, hf = model
    prefill = RunningPrefill(model_dir)
    prompt = prompts_of([70], seed=6)[0]  # 5 blocks of 16; 4 full before the last token
    try:
        with grpc.insecure_channel(prefill.address) as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            refusals = [
                (
                    held_request(prefill, prompt, 2, held_prefix_hash=b"\0" * 32),
                    "FAILED_PRECONDITION",
                    "differs",
                ),
                (held_request(prefill, prompt, 5), "INVALID_ARGUMENT", "at most the full blocks before"),
                (
                    held_request(prefill, prompt, 2, held_prefix_hash=b"short"),
                    "INVALID_ARGUMENT",
                    "has 5 bytes",
                ),
                (
                    held_request(prefill, prompt, 0, held_prefix_hash=b"x" * 32),
                    "INVALID_ARGUMENT",
                    "must be empty",
                ),
                (held_request(prefill, prompt, 2, cache_salt="other"), "FAILED_PRECONDITION", "differs"),
            ]
            for request, code, message in refusals:
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.Prefill(request, timeout=60))
                assert refused.value.code().name == code and message in refused.value.details()
            responses = list(stub.Prefill(held_request(prefill, prompt, 3), timeout=60))
        starts = {r.kv.block_start for r in responses if r.WhichOneof("kind") == "kv"}
        assert starts and min(starts) == 3, "blocks the caller holds are never sent"
        assert responses[-1].done.first_token_id == hf_greedy(hf, prompt, 1)[0]
        assert wait_until(prefill.pool_is_full)
    finally:
        prefill.close()


def test_three_prefill_replicas_keep_each_prefix_on_one_replica(model):
    model_dir, hf = model
    replicas = [RunningPrefill(model_dir) for _ in range(3)]
    decode = RunningDecode(model_dir, prefill=",".join(r.address for r in replicas), prefix_caching=False)
    try:
        assert wait_until(lambda: sum(r.state.name == "READY" for r in decode.pool.replicas) == 3)
        prefixes = prompts_of([48] * 4, seed=7)
        tails = prompts_of([5] * 3, seed=8)
        for p, prefix in enumerate(prefixes):
            for t, tail in enumerate(tails):
                (only,) = [r for r in decode.generate(prefix + tail, 1, f"p{p}-t{t}") if r.token_ids]
                assert list(only.token_ids) == hf_greedy(hf, prefix + tail, 1)
        for p in range(len(prefixes)):
            served_by = [
                i for i, r in enumerate(replicas) if any(f"p{p}-" in rid for rid in r.prefilled_request_ids())
            ]
            assert len(served_by) == 1, f"prefix {p} was prefilled on replicas {served_by}"
        assert sum(r.engine.block_manager.num_hit_tokens for r in replicas) == 4 * 2 * 48
        assert wait_until(decode.pool_is_full) and all(wait_until(r.pool_is_full) for r in replicas)
    finally:
        decode.close()
        for replica in replicas:
            replica.close()


def test_the_flags_turn_caching_off_and_salt_by_tenant():
    from decode_service.cli import service_config_from_args
    from serving.flags import engine_config_from_args
    from tandem.cli import build_parser

    parser = build_parser()
    defaults = parser.parse_args(["serve", "decode"])
    assert engine_config_from_args(defaults).enable_prefix_caching
    assert not service_config_from_args(defaults).cache_salt_by_tenant
    flags = parser.parse_args(["serve", "decode", "--no-prefix-caching", "--cache-salt-by-tenant"])
    assert not engine_config_from_args(flags).enable_prefix_caching
    assert service_config_from_args(flags).cache_salt_by_tenant
    assert parser.parse_args(["serve", "prefill", "--model", "m", "--no-prefix-caching"]).no_prefix_caching


def test_disaggregated_batch_sharing_a_long_prefix_at_once_matches_hf(model):
    """Six requests on one 96-token prefix arrive together, twice: outputs equal HF both times; the second
    wave finds the prefix cached on both tiers and transfers only the blocks after it."""
    model_dir, hf = model
    prefix = prompts_of([96], seed=9)[0]
    prompts = [prefix + tail for tail in prompts_of([3, 7, 12, 17, 1, 9], seed=10)]
    prefill = RunningPrefill(model_dir)
    decode = RunningDecode(model_dir, prefill=prefill.address)
    try:
        for wave in range(2):
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(decode.generate, p, 4, f"w{wave}-{i}") for i, p in enumerate(prompts)]
                outputs = [[t for r in f.result() for t in r.token_ids] for f in futures]
            assert outputs == [hf_greedy(hf, p, 4) for p in prompts], f"wave {wave} diverged"
        assert decode.stats.kv_blocks_skipped >= 6 * 6, "the second wave held the prefix's 6 blocks"
        assert wait_until(decode.pool_is_full) and wait_until(prefill.pool_is_full)
    finally:
        decode.close()
        prefill.close()


def test_under_the_local_threshold_after_the_cache_hit_decode_prefills_locally(model):
    model_dir, hf = model
    prefill = RunningPrefill(model_dir)
    decode = RunningDecode(model_dir, prefill=prefill.address, local_prefill_threshold=20)
    try:
        prompt = prompts_of([70], seed=11)[0]
        decode.generate(prompt, 2, "first")
        follow_up = prompt + prompts_of([5], seed=12)[0]  # 64 tokens held here, 11 left to compute
        tokens = [t for r in decode.generate(follow_up, 3, "follow-up") for t in r.token_ids]
        assert tokens == hf_greedy(hf, follow_up, 3)
        assert decode.locally_prefilled_request_ids() == {"follow-up"}
        assert decode.stats.remote_prefills_completed == 1
        assert wait_until(decode.pool_is_full) and wait_until(prefill.pool_is_full)
    finally:
        decode.close()
        prefill.close()
