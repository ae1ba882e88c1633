"""Schema-constrained answers of the real default model (SmolLM2-135M-Instruct) over the OpenAI API: every
schema of the benchmark's corpus (nested objects, arrays with item bounds, enums, anyOf, nullable fields,
patterns, bounded numbers and string lengths, `additionalProperties: false`), greedy and sampled, ends
with `stop` and validates against its schema."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from test_openai_api import MODEL, Server

from bench.structured_corpus import CORPUS, SYSTEM_PROMPT

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


@pytest.fixture(scope="module")
def server(real_model_dir):
    running = Server(real_model_dir, max_num_seqs=16, max_model_len=1024)
    yield running
    running.close()


def answer(server: Server, case, sampling: dict) -> tuple[str | None, str]:
    sampling = dict(sampling)
    response = server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": case.prompt}],
        max_tokens=sampling.pop("max_tokens", 400),
        response_format={"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}},
        **sampling,
    )
    return response.choices[0].finish_reason, response.choices[0].message.content


def test_every_corpus_schema_gets_a_valid_answer_greedy_and_sampled(server):
    for case in CORPUS:  # compiled once each; then the burst validates with the cheap requests
        answer(server, case, {"temperature": 0.0, "max_tokens": 1})
    jobs = [(case, {"temperature": 0.0}) for case in CORPUS]
    jobs += [(case, {"temperature": 1.0, "seed": seed}) for seed in (1, 2) for case in CORPUS]
    # The server admits this many constrained requests into validation at once (--max-validation-queue)
    # and answers one more with 429; a busy core can hold all 24 there together, so no more are in flight.
    admitted = server.server._validation._constrained.max_queue
    with ThreadPoolExecutor(max_workers=min(admitted, len(jobs))) as pool:
        answers = list(pool.map(lambda job: answer(server, *job), jobs))
    for (case, sampling), (finish, content) in zip(jobs, answers, strict=True):
        assert finish == "stop", (case.name, sampling, content)
        jsonschema.validate(json.loads(content), case.schema)
    assert server.engine.kv_usage == 0
