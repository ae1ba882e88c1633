"""Exceptions raised while moving KV blocks between tiers.

A KV chunk crosses the network, so every one of its fields is untrusted; each way it can be
wrong has its own exception so that the receiver can count and log failures by kind. All of
them mean "this transfer is unusable": the receiver writes nothing from the chunk and the
decode tier's gRPC edge fails the request.
"""

from base.errors import IncompatibleKVError, TandemError


class KVTransferError(TandemError):
    """Base class for every problem with a KV transfer."""


class KVChecksumError(KVTransferError):
    """The payload's CRC32C does not match the one the sender computed (corruption in transit)."""


class KVLayoutMismatchError(KVTransferError):
    """The chunk's dtype or shape does not match the receiver's KV layout, or a layout is invalid."""


class KVRangeError(KVTransferError):
    """The chunk names layers or blocks outside what the receiver holds for the request."""


class KVPayloadSizeError(KVTransferError):
    """The payload's length disagrees with its shape, or one block does not fit in a message."""


class KVNonFiniteError(KVTransferError):
    """The payload holds a NaN or an infinity (a K or V value, or a quantized cache's scale), or the first
    token's logprob is NaN.

    The checksum only proves the bytes are the sender's; a sender with broken numerics (or a rogue one)
    can still send NaN. Such KV would poison every token decoded over it, and every later request that
    shares its prefix through the prefix cache, so it is refused like a corrupt chunk.
    """


class KVFramingError(KVTransferError):
    """A Prefill response's bytes are not a valid protobuf message (truncated, overlong, bad wire type)."""


class PrefixMismatchError(IncompatibleKVError):
    """The caller's prefix-cache chain hash for the blocks it holds differs from the one computed here.

    Equal prompts, salts and model namespaces give equal chains, so a mismatch means the two replicas
    hash differently (another tandem version): their cached blocks cannot be combined. Maps to
    FAILED_PRECONDITION like any incompatibility; the KV would otherwise be silently mixed.
    """
