"""Checks a `PrefillRequest` and turns it into a prefill job.

Order matters to the caller: an incompatible replica is reported first (FAILED_PRECONDITION: no
retry with the same replica can help), then anything wrong with the request itself
(INVALID_ARGUMENT), each with a message naming what to fix.
"""

from __future__ import annotations

import uuid

from base.errors import InvalidRequestError
from engine.engine import Engine
from engine.params import StoppingParams
from engine.sequence import Sequence
from kv_transfer import IncompatibleKVError, PrefixMismatchError
from prefill_service.job import PrefillJob
from protos.tandem.internal.v1 import prefill_pb2
from serving.sampling import sampling_params

PREFIX_HASH_BYTES = 32
# Prefill computes the prompt's KV and samples exactly one token; the decode tier applies the stop rules.
PREFILL_STOPPING = StoppingParams(max_tokens=1, ignore_eos=True)


def check_compatible(caller_hash: str, own_hash: str) -> None:
    """Refuse a caller whose KV layout or model differs from ours, before any KV moves."""
    if caller_hash != own_hash:
        shown = caller_hash[:16] if caller_hash else "(empty)"
        raise IncompatibleKVError(
            f"compatibility_hash {shown}... differs from this prefill replica's {own_hash[:16]}...: "
            "different model, dtype, block size or KV wire format; call GetInfo and use a compatible replica"
        )


def build_job(
    request: prefill_pb2.PrefillRequest, engine: Engine, own_hash: str, arrival_time: float
) -> PrefillJob:
    """Validate a request against this replica and return its job (not yet queued)."""
    check_compatible(request.compatibility_hash, own_hash)
    # The decode tier names every prefill; a hand-made call (grpcurl) may not, and still gets a log id.
    request_id = request.request_id or f"prefill-{uuid.uuid4().hex}"
    seq = engine.make_sequence(
        list(request.prompt_token_ids),
        sampling_params(request.sampling, engine.vocab_size),
        PREFILL_STOPPING,
        request_id,
        cache_salt=request.cache_salt,
    )
    needed = engine.blocks_for_tokens(seq.num_prompt_tokens)
    pool = engine.num_blocks
    if needed > pool:
        raise InvalidRequestError(
            f"the prompt needs {needed} KV blocks but this prefill replica's pool has {pool}; "
            "it can never be prefilled here"
        )
    check_held_prefix(request, engine, seq)
    return PrefillJob(seq, arrival_time, first_block=request.num_held_blocks)


def check_held_prefix(request: prefill_pb2.PrefillRequest, engine: Engine, seq: Sequence) -> None:
    """The caller holds `num_held_blocks` leading full blocks: a sensible count, with our chain hash.

    The caller never holds the block with the prompt's last token (it is always computed, to sample).
    """
    held = request.num_held_blocks
    if held * engine.block_size > seq.num_prompt_tokens - 1:
        raise InvalidRequestError(
            f"num_held_blocks {held} covers {held * engine.block_size} tokens; a caller holds at most the "
            f"full blocks before the last prompt token ({(seq.num_prompt_tokens - 1) // engine.block_size})"
        )
    if not held:
        if request.held_prefix_hash:
            raise InvalidRequestError("held_prefix_hash must be empty when num_held_blocks is 0")
        return
    if len(request.held_prefix_hash) != PREFIX_HASH_BYTES:
        raise InvalidRequestError(
            f"held_prefix_hash has {len(request.held_prefix_hash)} bytes; a SHA-256 chain hash has "
            f"{PREFIX_HASH_BYTES}"
        )
    if engine.prefix_hash(seq, held) != request.held_prefix_hash:
        raise PrefixMismatchError(
            f"held_prefix_hash after {held} blocks differs from this prefill replica's chain for the same "
            "tokens and cache_salt: the replicas hash prefixes differently (another tandem version?)"
        )
