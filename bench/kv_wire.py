"""The KV wire alone over loopback: the real sender and codec in one process, the receiver in this one.

No model runs: the sender process holds random caches with the model's KV layout and answers each
Prefill call by streaming the prompt's blocks through the prefill tier's KVSender (the same frames,
serializer and channel options as the server), then a PrefillDone. This process receives with the
decode tier's stub and writes each frame into its own cache on a one-thread executor, like the decode
tier's prefill client. Both block tables are random permutations, the worst case for the copies (no
run of consecutive physical blocks to copy at once). Timed: from the call to PrefillDone, in wall-clock
seconds and in CPU seconds of each process (the latter move far less on a loaded machine).
"""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

import crc32c
import grpc
import torch

from decode_service.engine_core.remote_prefill.write_pipeline import WritePipeline
from engine.kv_cache import KVCache
from kv_transfer import KVFrame, KVLayout, PagedKV
from kv_transfer.grpc_method import (
    CLIENT_CHANNEL_OPTIONS,
    MESSAGE_HEADROOM_BYTES,
    PrefillStub,
    add_prefill_servicer,
)
from kv_transfer.heap import keep_message_buffers_in_heap
from prefill_service.job import KVReady
from prefill_service.kv_sender import KVSender
from protos.tandem.internal.v1 import prefill_pb2


@dataclass(frozen=True)
class WireSetup:
    """What both processes need to agree on."""

    layout: KVLayout
    num_physical_blocks: int
    max_payload_bytes: int

    def channel_options(self) -> list[tuple[str, int]]:
        limit = self.max_payload_bytes + MESSAGE_HEADROOM_BYTES
        return [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            *(option for option in CLIENT_CHANNEL_OPTIONS if option[0] == "grpc.http2.max_frame_size"),
        ]

    def caches(self, seed: int) -> KVCache:
        generator = torch.Generator().manual_seed(seed)
        shape = (self.num_physical_blocks, *self.layout.block_shape)

        def one() -> torch.Tensor:
            return torch.randn(shape, generator=generator).to(self.layout.dtype)

        layers = range(self.layout.num_layers)
        return KVCache([one() for _ in layers], [one() for _ in layers])

    def block_table(self, num_tokens: int, seed: int) -> tuple[int, ...]:
        num_blocks = math.ceil(num_tokens / self.layout.block_size)
        return tuple(random.Random(seed).sample(range(self.num_physical_blocks), num_blocks))


class _SyntheticPrefill:
    """Answers Prefill by streaming the blocks of a prompt of the requested length."""

    def __init__(self, setup: WireSetup) -> None:
        self._setup = setup
        self._sender = KVSender(
            setup.caches(seed=0), setup.layout, torch.device("cpu"), max_payload_bytes=setup.max_payload_bytes
        )

    async def GetInfo(self, request, context) -> prefill_pb2.PrefillInfo:  # noqa: N802 (gRPC's name)
        return prefill_pb2.PrefillInfo()

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context):  # noqa: N802 (gRPC's name)
        """The blocks, then a PrefillDone whose prefill_seconds is this process's CPU time for the call."""
        cpu_started = time.process_time()
        num_tokens = len(request.prompt_token_ids)
        table = self._setup.block_table(num_tokens, seed=num_tokens)
        async for frame in self._sender.frames(KVReady(0, len(table), num_tokens, table)):
            yield frame
        timings = prefill_pb2.PrefillTimings(prefill_seconds=time.process_time() - cpu_started)
        yield prefill_pb2.PrefillResponse(
            done=prefill_pb2.PrefillDone(num_prompt_tokens=num_tokens, timings=timings)
        )


def _serve(setup: WireSetup, conn: Connection) -> None:
    async def serve() -> None:
        server = grpc.aio.server(options=setup.channel_options())
        add_prefill_servicer(_SyntheticPrefill(setup), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(0)

    torch.set_num_threads(1)
    keep_message_buffers_in_heap()
    asyncio.run(serve())


async def _receive(setup: WireSetup, port: int, lengths: list[int], repeats: int) -> list[dict]:
    keep_message_buffers_in_heap()
    cache = setup.caches(seed=1)
    receiver = PagedKV(cache.k, cache.v, setup.layout)
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-write")
    rows = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=setup.channel_options()) as channel:
        stub = PrefillStub(channel)
        for length in [lengths[0], *lengths]:  # the first call warms the connection and is dropped
            seconds, sender_cpu, receiver_cpu, payload, messages = [], [], [], 0, 0
            for repeat in range(repeats):
                table = setup.block_table(length, seed=1000 + repeat)
                payload = messages = 0
                started, cpu_started = time.perf_counter(), time.process_time()
                request = prefill_pb2.PrefillRequest(prompt_token_ids=range(length))
                write = functools.partial(receiver.write, block_table=table, num_logical_blocks=len(table))
                writes = WritePipeline(writer, write)
                async for response in stub.Prefill(request):
                    if isinstance(response, Exception):
                        raise response
                    if isinstance(response, KVFrame):
                        payload += await writes.put(response)
                        messages += 1
                    else:
                        payload += await writes.flush()
                        sender_cpu.append(response.done.timings.prefill_seconds)
                seconds.append(time.perf_counter() - started)
                receiver_cpu.append(time.process_time() - cpu_started)
            rows.append(
                {
                    "prompt_tokens": length,
                    "payload_bytes": payload,
                    "messages": messages,
                    "seconds_median": statistics.median(seconds),
                    "seconds_all": seconds,
                    "GBps": payload / statistics.median(seconds) / 1e9,
                    "sender_cpu_seconds_median": statistics.median(sender_cpu),
                    "receiver_cpu_seconds_median": statistics.median(receiver_cpu),
                    # What a quiet machine with a core per side could reach: the busier side bounds it.
                    "cpu_bound_GBps": payload
                    / max(statistics.median(sender_cpu), statistics.median(receiver_cpu))
                    / 1e9,
                }
            )
    writer.shutdown()
    return rows[1:]


def measure_wire(layout: KVLayout, lengths: list[int], message_sizes: list[int], repeats: int) -> list[dict]:
    """GB/s of the wire per prompt length, for each payload budget per message."""
    num_physical_blocks = math.ceil(max(lengths) / layout.block_size) + 8
    results = []
    context = multiprocessing.get_context("spawn")
    for max_payload_bytes in message_sizes:
        setup = WireSetup(layout, num_physical_blocks, max_payload_bytes)
        parent, child = context.Pipe()
        sender = context.Process(target=_serve, args=(setup, child), daemon=True)
        sender.start()
        try:
            deadline = time.monotonic() + 300
            while not parent.poll(1):
                if not sender.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the sender process did not start (exit code {sender.exitcode})")
            port = parent.recv()
            rows = asyncio.run(_receive(setup, port, lengths, repeats))
        finally:
            parent.send("stop")
            sender.join(30)
        for row in rows:
            row["max_payload_bytes"] = max_payload_bytes
        results += rows
    return results


def measure_crc32c(num_bytes: int = 64 << 20, repeats: int = 5) -> float:
    """GB/s of one CRC32C pass (the sender computes one and the receiver checks one per byte)."""
    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).numpy().tobytes()
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        crc32c.crc32c(data)
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9
