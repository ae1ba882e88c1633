"""The Gateway API Inference Extension's model-server protocol on the OpenAI HTTP port: what its endpoint
picker scrapes from a vLLM server, under vLLM's names, types and labels, moving with the load."""

from __future__ import annotations

import urllib.request

import pytest
from conftest import save_tiny_model, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_openai_api import MODEL, Server

from protos.tandem.v1 import generation_pb2 as pb

# name -> type, per the protocol document (docs/proposals/003-model-server-protocol).
GATEWAY_METRICS = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-gateway-model")
    save_tiny_model(directory, 23)
    running = Server(directory, max_num_seqs=1)
    yield running
    running.close()


def scrape(server: Server) -> dict[str, list]:
    """Every metric family of the HTTP port's /metrics (no bearer token), by name."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families, name: str) -> float:
    (sample,) = families[name].samples
    return sample.value


def long_stream(server: Server, request_id: str):
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt="Once upon a time",
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(max_tokens=200, ignore_eos=True),
    )
    return server.stub.Generate(request, timeout=120)


def test_the_http_port_serves_the_gateway_protocol_moving_with_the_load(server):
    idle = scrape(server)
    for name, kind in GATEWAY_METRICS.items():
        assert idle[name].type == kind, name
    (config,) = idle["vllm:cache_config_info"].samples
    assert config.labels == {"model_name": MODEL, "block_size": "8", "num_gpu_blocks": "256"}
    (lora,) = idle["vllm:lora_requests_info"].samples
    assert lora.labels["max_lora"] == "0" and lora.value > 0
    assert value(idle, "vllm:num_requests_waiting") == 0 == value(idle, "vllm:num_requests_running")
    assert value(idle, "vllm:kv_cache_usage_perc") == 0
    assert "tandem:num_requests_running" in idle  # the tier's own names are served there too

    first = long_stream(server, "holds-the-seat")
    next(first)
    second = long_stream(server, "waits")  # the server runs one sequence at a time
    try:
        assert wait_until(lambda: value(scrape(server), "vllm:num_requests_waiting") == 1, timeout=30)
        busy = scrape(server)
        assert value(busy, "vllm:num_requests_running") == 1
        assert value(busy, "vllm:kv_cache_usage_perc") > 0
    finally:
        first.cancel()
        second.cancel()
    assert wait_until(server.idle)
    assert wait_until(lambda: value(scrape(server), "vllm:kv_cache_usage_perc") == 0)
