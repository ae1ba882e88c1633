"""Python client of the tandem public API (tandem.v1.Generation), blocking and asyncio.

from tandem.client import TandemClient

with TandemClient("localhost:50051") as client:
    for delta in client.generate("Once upon a time", max_tokens=32, temperature=0.7):
        print(delta.text, end="", flush=True)
"""

from tandem.client.async_client import AsyncTandemClient
from tandem.client.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    TandemError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)
from tandem.client.requests import RequestOptions
from tandem.client.results import (
    Completion,
    FinishReason,
    GenerationDelta,
    ModelInfo,
    ServerTimings,
    ServingMode,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tandem.client.sync_client import TandemClient

__all__ = [
    "Aborted",
    "AlreadyExists",
    "AsyncTandemClient",
    "Cancelled",
    "Completion",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FinishReason",
    "GenerationDelta",
    "Internal",
    "InvalidArgument",
    "ModelInfo",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "RequestOptions",
    "ResourceExhausted",
    "ServerTimings",
    "ServingMode",
    "TandemClient",
    "TandemError",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "Usage",
]
