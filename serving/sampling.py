"""The public `SamplingParams` message read the same way on both tiers: unset fields take the API's defaults.

The decode tier reads it from a client's request and forwards the very message to the prefill tier, which
samples the first token; both must turn it into identical `engine.params.SamplingParams`, or a
disaggregated first token would differ from an aggregated one.
"""

from __future__ import annotations

from engine.params import SamplingParams
from protos.tandem.v1 import generation_pb2


def sampling_params(proto: generation_pb2.SamplingParams, vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams with the server defaults for unset fields; validated (logit_bias ids below vocab)."""
    params = SamplingParams(
        temperature=proto.temperature if proto.HasField("temperature") else 1.0,
        top_p=proto.top_p if proto.HasField("top_p") else 1.0,
        top_k=proto.top_k if proto.HasField("top_k") else -1,
        min_p=proto.min_p if proto.HasField("min_p") else 0.0,
        seed=proto.seed if proto.HasField("seed") else None,
        logprobs=proto.logprobs,
        presence_penalty=proto.presence_penalty if proto.HasField("presence_penalty") else 0.0,
        frequency_penalty=proto.frequency_penalty if proto.HasField("frequency_penalty") else 0.0,
        repetition_penalty=proto.repetition_penalty if proto.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(proto.logit_bias),
        disable_speculation=proto.disable_speculation,
    )
    params.validate(vocab_size)
    return params
