"""Decode-tier settings: flag parsing (the Helm chart's CLI contract), config checks, the error-to-status
mapping, and the JSON log format."""

from __future__ import annotations

import dataclasses
import json
import logging

import grpc
import pytest
import torch

from base.errors import ConfigError, InvalidRequestError
from base.logs import JsonFormatter
from decode_service.cli import service_config_from_args
from decode_service.config import DecodeServiceConfig, parse_tenant_weights
from decode_service.engine_core.config import CoreConfig
from decode_service.engine_core.policies import POLICY_NAMES, WeightedFairQueuingPolicy, make_policy
from decode_service.front_door.config import FrontDoorConfig, HttpConfig
from engine.config import parse_memory_size
from serving.errors import DrainingError, QueueFullError
from serving.flags import engine_config_from_args
from serving.status import status_for
from tandem.cli import build_parser


def test_tenant_weights_parse():
    assert parse_tenant_weights("a=2,b=1") == {"a": 2.0, "b": 1.0}
    assert parse_tenant_weights(" gold = 3.5 , ") == {"gold": 3.5}
    assert parse_tenant_weights("") == {}
    for bad in ("a", "=2", "a=x", "a=0", "a=-1"):
        with pytest.raises(ConfigError):
            parse_tenant_weights(bad)


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5G", 1_500_000_000), ("4096", 4096), ("2Gi", 2 << 30)],
)
def test_memory_size_parse(text, size):
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "2 parsecs", "-1GiB", "0"])
def test_memory_size_rejects_nonsense(text):
    with pytest.raises(ConfigError):
        parse_memory_size(text)


@pytest.mark.parametrize(
    "change",
    [
        {"batching": "dynamic"},
        {"port": 70000},
        {"max_queue": -1},
        {"max_tokens_cap": 0},
        {"stream_interval": 0},
        {"admission_watermark": 1.0},
        {"max_prefills_per_step": -1},
        {"drain_grace_seconds": -1},
        {"event_log_size": 0},
        {"engine_heartbeat_timeout_s": 0},
    ],
)
def test_config_rejects_out_of_range_settings(change):
    DecodeServiceConfig().validate()
    with pytest.raises(ConfigError):
        DecodeServiceConfig(**change).validate()


def test_the_flags_defaults_are_their_parts_defaults():
    config = DecodeServiceConfig()
    assert (config.core, config.front_door, config.http) == (CoreConfig(), FrontDoorConfig(), HttpConfig())


def test_each_half_of_the_server_gets_its_part_and_the_core_no_more():
    config = DecodeServiceConfig(
        policy="wfq",
        prefill="localhost:50052",
        grammar_cache_size=3,
        event_log_size=5,
        max_tokens_cap=7,
        http_port=8000,
        auth_token="secret",
    )
    core = config.core
    assert (core.scheduler.policy, core.grammar.grammar_cache_size, core.event_log_size) == ("wfq", 3, 5)
    assert core.remote_prefill.disaggregated and config.disaggregated
    assert (config.front_door.max_tokens_cap, config.http.http_port) == (7, 8000)
    # The core process is handed `core` alone: no HTTP setting, no auth token, no request limit.
    assert not field_names(core) & {"auth_token", "tls", "http_port", "max_tokens_cap", "limits"}


def field_names(config: object) -> set[str]:
    """The names of a config's fields and of its parts' fields, at any depth."""
    names = set()
    for item in dataclasses.fields(config):
        names.add(item.name)
        value = getattr(config, item.name)
        if dataclasses.is_dataclass(value):
            names |= field_names(value)
    return names


def test_policies_by_name():
    assert {make_policy(name).name for name in POLICY_NAMES} == set(POLICY_NAMES)
    with pytest.raises(ConfigError, match="policy must be one of"):
        make_policy("lottery")
    with pytest.raises(ConfigError):
        WeightedFairQueuingPolicy({"a": 0.0})
    with pytest.raises(ConfigError):
        make_policy("sjf", sjf_aging_tokens_per_second=-1)


def test_serve_decode_accepts_the_helm_chart_flags():
    args = build_parser().parse_args(
        [
            "serve",
            "decode",
            "--model",
            "/models/m",
            "--dtype",
            "bfloat16",
            "--block-size",
            "32",
            "--host",
            "0.0.0.0",
            "--port",
            "50051",
            "--metrics-port",
            "9090",
            "--kv-cache-memory",
            "2GiB",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "512",
            "--max-model-len",
            "2048",
            "--policy",
            "wfq",
            "--tenant-weights",
            "a=2,b=1",
            "--batching",
            "static",
            "--threads",
            "4",
            "--drain-grace-seconds",
            "30",
            "--log-format",
            "json",
            "--max-queue",
            "10",
            "--max-tokens-cap",
            "100",
        ]
    )
    assert (args.command, args.tier) == ("serve", "decode")
    assert (args.policy, args.batching, args.block_size, args.max_model_len) == ("wfq", "static", 32, 2048)
    assert args.handler.__name__ == "_run_serve_decode"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "decode", "--model", "m", "--policy", "random"])


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("auto", None), ("0", 0), ("3", 3)])
def test_max_prefills_per_step_takes_auto_or_a_count(value, expected):
    flag = [] if value is None else ["--max-prefills-per-step", value]
    args = build_parser().parse_args(["serve", "decode", "--model", "m", *flag])
    assert service_config_from_args(args).scheduler.max_prefills_per_step == expected


@pytest.mark.parametrize("value", ["-1", "two", "1.5", ""])
def test_max_prefills_per_step_refuses_other_values(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "decode", "--model", "m", "--max-prefills-per-step", value])
    assert f"expected auto or a count >= 0, got {value!r}" in capsys.readouterr().err


def test_flags_become_engine_and_service_configs(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_AUTH_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    args = build_parser().parse_args(
        [
            "serve",
            "decode",
            "--dtype",
            "bfloat16",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "512MiB",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "256",
            "--policy",
            "wfq",
            "--tenant-weights",
            "a=2",
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
            "--auth-token-file",
            str(token_file),
        ]
    )
    assert args.model is None
    engine_config = engine_config_from_args(args)
    assert (engine_config.dtype, engine_config.cache.block_size) == (torch.bfloat16, 32)
    assert engine_config.cache.memory_bytes == 512 << 20
    assert (engine_config.max_num_seqs, engine_config.max_num_batched_tokens) == (8, 256)
    config = service_config_from_args(args)
    assert (config.policy, dict(config.tenant_weights), config.auth_token) == ("wfq", {"a": 2.0}, "s3cret")
    assert config.engine_heartbeat_timeout_s == 30.0
    heartbeat = build_parser().parse_args(["serve", "decode", "--engine-heartbeat-timeout", "2.5"])
    assert service_config_from_args(heartbeat).engine_heartbeat_timeout_s == 2.5
    assert "s3cret" not in repr(config)

    half_tls = build_parser().parse_args(["serve", "decode", "--tls-cert", "c.pem"])
    with pytest.raises(ConfigError, match="go together"):
        service_config_from_args(half_tls)
    no_seqs = build_parser().parse_args(["serve", "decode", "--max-num-seqs", "0"])
    with pytest.raises(ConfigError, match="--max-num-seqs must be >= 1"):
        engine_config_from_args(no_seqs)


def test_errors_map_to_status_codes_in_one_place():
    assert status_for(InvalidRequestError("bad top_p")) == (grpc.StatusCode.INVALID_ARGUMENT, "bad top_p")
    assert status_for(QueueFullError("full"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(DrainingError("bye"))[0] == grpc.StatusCode.UNAVAILABLE
    code, message = status_for(RuntimeError("secret internals"))
    assert code == grpc.StatusCode.INTERNAL and "secret" not in message


def test_json_log_lines_carry_extra_fields():
    record = logging.LogRecord("tandem.test", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    record.num_blocks = 12
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "hello world"
    assert entry["level"] == "INFO" and entry["logger"] == "tandem.test"
    assert entry["num_blocks"] == 12


def test_speculative_flags_default_to_the_config_and_reach_the_engine():
    from engine.speculation import SpeculativeConfig

    defaults = build_parser().parse_args(["serve", "decode"])
    assert engine_config_from_args(defaults).speculative == SpeculativeConfig()
    args = build_parser().parse_args(
        ["serve", "decode", "--speculative", "ngram", "--num-speculative-tokens", "2"]
    )
    speculative = engine_config_from_args(args).speculative
    assert (speculative.method, speculative.num_speculative_tokens) == ("ngram", 2)
    bad = build_parser().parse_args(["serve", "decode", "--speculative", "ngram", "--prompt-lookup-min", "0"])
    with pytest.raises(ConfigError, match="--prompt-lookup-min"):
        engine_config_from_args(bad)
