"""The front door's parts of the decode configuration, read by the code that serves requests
(`DecodeServiceConfig` in `decode_service.config` holds the flags and hands each door its part).

`FrontDoorConfig`: `limits` bound each request (see `RequestLimits`); `max_tokens_cap` is the default
`max_tokens` when a request leaves it unset (further capped by what the context has left);
`stream_interval` tokens go in one stream message (see `streams`). At most `max_validation_queue` large
prompts wait for the tokenizer; a stream may fall `max_stream_buffer` messages behind before it is
cancelled. `tenant_header`/`priority_header` name request headers, set by a trusted gateway, that
replace the client's own `tenant`/`priority` fields. `cache_salt_by_tenant` folds each request's tenant
into its prefix-cache salt, so tenants never share cached blocks (see the README's security section on
the cache's timing side channel). `chat_template` (a Jinja file, or the template inline) replaces the
model's template, or gives a model without one (a base model) chat endpoints. `tool_call_parser` reads
the calls a model writes under tool_choice auto; `reasoning_parser` splits off its `<think>` reasoning,
and grammars then apply only after `</think>`. `served_model_name` is the model name the APIs answer to
(None: the engine's).

`HttpConfig`: the OpenAI-compatible HTTP API on the same host, process and engine (`http_port` None:
off), and against slow or piled-up clients the open connections it holds at most and the seconds a
client has to send a whole request. `enable_responses_store` keeps finished Responses API answers in
memory for `previous_response_id` and `GET /v1/responses/{id}`: at most `responses_store_bytes`, each
for `responses_store_ttl_s` seconds (see `openai_http.response_store`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from base.errors import ConfigError
from decode_service.chat_template import read_chat_template
from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.reasoning import REASONING_PARSERS
from decode_service.front_door.tool_parsers import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class FrontDoorConfig:
    served_model_name: str | None = None
    max_tokens_cap: int = 4096
    stream_interval: int = 1
    cache_salt_by_tenant: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_validation_queue: int = 16
    max_stream_buffer: int = 1024
    tenant_header: str = ""
    priority_header: str = ""
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def validate(self) -> None:
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name must not be empty")
        for name in ("max_tokens_cap", "stream_interval", "max_validation_queue", "max_stream_buffer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.limits.validate()
        if self.chat_template is not None:
            read_chat_template(self.chat_template)
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            value = getattr(self, name)
            if value is not None and value not in known:
                raise ConfigError(f"{name} must be one of {', '.join(known)}, not {value!r}")


@dataclass(frozen=True)
class HttpConfig:
    http_port: int | None = None
    http_max_connections: int = 4096
    http_read_timeout_s: float = 30.0
    enable_responses_store: bool = False
    responses_store_bytes: int = 64 * 2**20
    responses_store_ttl_s: float = 3600.0

    def validate(self) -> None:
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ConfigError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http_max_connections < 1:
            raise ConfigError(f"http_max_connections must be >= 1, got {self.http_max_connections}")
        if not self.http_read_timeout_s > 0:
            raise ConfigError(f"http_read_timeout_s must be > 0, got {self.http_read_timeout_s}")
        if self.responses_store_bytes < 1:
            raise ConfigError(f"responses_store_bytes must be >= 1, got {self.responses_store_bytes}")
        if not self.responses_store_ttl_s > 0:
            raise ConfigError(f"responses_store_ttl_s must be > 0, got {self.responses_store_ttl_s}")
