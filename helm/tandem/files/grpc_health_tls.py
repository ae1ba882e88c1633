"""Check a tandem server's grpc.health.v1 status through TLS, for Kubernetes exec probes.

The kubelet's native gRPC probe connects in plaintext only, so it cannot probe a port that
serves TLS (let alone mTLS). This client runs inside the pod, connects to 127.0.0.1 while
verifying the certificate against the name clients use, and exits 0 only when the overall
service ("") is SERVING: the same meaning as the native probe.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(path: str | None) -> bytes | None:
    """None lets gRPC fall back to the system roots (public CA) when no CA file is mounted."""
    if not path or not Path(path).is_file():
        return None
    return Path(path).read_bytes()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--server-name", required=True, help="name the server certificate is valid for")
    parser.add_argument("--ca", help="CA bundle that signed the server certificate")
    parser.add_argument("--cert", help="client certificate, for servers that require mTLS")
    parser.add_argument("--key", help="client private key, for servers that require mTLS")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds")
    return parser.parse_args(argv)


def check(args: argparse.Namespace) -> bool:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(args.ca), private_key=_read(args.key), certificate_chain=_read(args.cert)
    )
    options = [("grpc.ssl_target_name_override", args.server_name)]
    with grpc.secure_channel(f"{args.host}:{args.port}", credentials, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        serving = check(args)
    except grpc.RpcError as exc:
        sys.stderr.write(f"health check failed: {exc.code().name}: {exc.details()}\n")
        return 1
    if not serving:
        sys.stderr.write("health check: not SERVING\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
