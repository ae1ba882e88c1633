"""Client-side load balancing over decode replicas: one client's requests spread over two replicas, and
keep succeeding after one of them is killed."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import save_tiny_model

from decode_service.config import DecodeServiceConfig
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from tandem.client import TandemClient
from tandem.client.connection import ROUND_ROBIN_SERVICE_CONFIG, ConnectionSettings


class Replica:
    """One decode server on its own event-loop thread, counting the requests it was sent."""

    def __init__(self, model_dir) -> None:
        engine_config = EngineConfig(
            cache=CacheConfig(block_size=8, num_blocks=64),
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=64,
        )
        self.engine = Engine.from_pretrained(model_dir, engine_config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = DecodeServiceConfig(host="127.0.0.1", port=0)
        self.server = self.call(self._create(config))
        self.port = self.call(self.server.start())

    async def _create(self, config: DecodeServiceConfig) -> DecodeServer:
        return DecodeServer(self.engine, config)

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def served(self, prefix: str) -> int:
        """How many of the requests whose id starts with `prefix` ran here."""
        ids = {c.request_id for step in self.server.events.snapshot() for c in step.chunks}
        return sum(1 for request_id in ids if request_id.startswith(prefix))

    def kill(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def replicas(tmp_path):
    save_tiny_model(tmp_path, 5)
    started = [Replica(tmp_path), Replica(tmp_path)]
    yield started
    for replica in started:
        if replica.thread.is_alive():
            replica.kill()


def test_multi_address_targets_get_round_robin_and_plain_ones_do_not():
    for target in ("dns:///tandem-decode-headless.inference.svc:50051", "ipv4:10.0.0.1:1,10.0.0.2:1"):
        options = dict(ConnectionSettings.create(target).options)
        assert '"round_robin"' in options["grpc.service_config"]
    assert "grpc.service_config" not in dict(ConnectionSettings.create("localhost:50051").options)
    own = ConnectionSettings.create("dns:///x:1", options=[("grpc.service_config", "{}")]).options
    assert own == (("grpc.service_config", "{}"),), "a caller's own service config wins"
    assert ROUND_ROBIN_SERVICE_CONFIG["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == [
        "UNAVAILABLE"
    ]


@pytest.mark.slow
def test_one_client_spreads_over_two_replicas_and_survives_losing_one(replicas):
    first, second = replicas
    target = f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"
    with TandemClient(target, timeout=60) as client:
        for i in range(8):
            done = client.complete(
                token_ids=[5, 6, 7], max_tokens=2, temperature=0.0, request_id=f"spread-{i}"
            )
            assert done.finish_reason == "length"
        assert first.served("spread-") + second.served("spread-") == 8
        assert first.served("spread-") >= 2 and second.served("spread-") >= 2, "round-robin, not pinned"

        first.kill()
        for i in range(6):
            done = client.complete(
                token_ids=[5, 6, 7], max_tokens=2, temperature=0.0, request_id=f"after-{i}"
            )
            assert done.finish_reason == "length"
        assert second.served("after-") == 6
