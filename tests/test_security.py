"""TLS, mTLS and bearer-token auth (`base.auth`) on loopback, with throwaway CAs made per module.

The server runs a small Generation servicer (a unary and a server-streaming method) plus health and
reflection, so the interceptor is exercised on every call kind the real servers expose.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from base.auth import (
    BearerTokenInterceptor,
    CredentialsError,
    channel_credentials,
    load_auth_token,
    server_credentials,
)
from base.settings import AUTH_TOKEN_ENV
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc
from tandem.client import TandemClient, Unauthenticated, Unavailable

TOKEN = "correct-horse-battery-staple"
SAFETY_TIMEOUT = 20.0
GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name


# --- a throwaway PKI ---


@dataclass(frozen=True)
class Identity:
    cert: Path
    key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    encoding, key_format = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    path.write_bytes(key.private_bytes(encoding, key_format, serialization.NoEncryption()))
    return path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class CertificateAuthority:
    """A self-signed CA (P-256, fast to generate) that issues server and client certificates."""

    def __init__(self, directory: Path, name: str) -> None:
        self._directory = directory
        self._name = _name(name)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name}-ca.pem"
        self.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, server: bool) -> Identity:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = builder.sign(self._key, hashes.SHA256())
        cert_path = self._directory / f"{name}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Identity(cert_path, _write_key(key, self._directory / f"{name}-key.pem"))


@dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    server: Identity
    client: Identity
    rogue_ca: CertificateAuthority
    rogue_server: Identity
    rogue_client: Identity


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory, "tandem")
    rogue = CertificateAuthority(directory, "rogue")
    return Pki(
        ca,
        ca.issue("server", server=True),
        ca.issue("client", server=False),
        rogue,
        rogue.issue("rogue-server", server=True),
        rogue.issue("rogue-client", server=False),
    )


# --- a server on its own event-loop thread ---


class EchoGeneration(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        yield pb.GenerateResponse(request_id="r", text=request.prompt, finish_reason=pb.STOP)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        return pb.ModelInfo(model_name="secure-model")


class SecureServer:
    """Generation + health + reflection with optional TLS credentials and a token interceptor."""

    def __init__(
        self, credentials: grpc.ServerCredentials | None, token: str | list[str] | None = None
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        interceptors = [BearerTokenInterceptor(token)] if token else []
        self.port = self._call(self._start(credentials, interceptors))

    async def _start(self, credentials, interceptors) -> int:
        self._server = grpc.aio.server(interceptors=interceptors)
        generation_pb2_grpc.add_GenerationServicer_to_server(EchoGeneration(), self._server)
        health = HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, self._server)
        reflection.enable_server_reflection((GENERATION_SERVICE, reflection.SERVICE_NAME), self._server)
        address = "127.0.0.1:0"
        if credentials is None:
            port = self._server.add_insecure_port(address)
        else:
            port = self._server.add_secure_port(address, credentials)
        await self._server.start()
        return port

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(SAFETY_TIMEOUT)

    def close(self) -> None:
        self._call(self._server.stop(grace=None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(SAFETY_TIMEOUT)
        self._loop.close()


@pytest.fixture
def start_server():
    servers: list[SecureServer] = []

    def start(credentials=None, token=None) -> str:
        servers.append(SecureServer(credentials, token))
        return f"127.0.0.1:{servers[-1].port}"

    yield start
    for server in servers:
        server.close()


def model_name(target: str, **client_kwargs) -> str:
    with TandemClient(target, timeout=SAFETY_TIMEOUT, **client_kwargs) as client:
        return client.model_info().model_name


# --- TLS and mTLS ---


def test_tls_call_succeeds(pki, start_server):
    target = start_server(server_credentials(pki.server.cert, pki.server.key))
    assert model_name(target, ca_cert=pki.ca.cert) == "secure-model"


def test_tls_server_name_override(pki, start_server):
    target = start_server(server_credentials(pki.server.cert, pki.server.key))
    assert model_name(target, ca_cert=pki.ca.cert, tls_server_name="localhost") == "secure-model"
    with pytest.raises(Unavailable):
        model_name(target, ca_cert=pki.ca.cert, tls_server_name="someone-else.example")


def test_plaintext_client_cannot_talk_to_a_tls_server(pki, start_server):
    target = start_server(server_credentials(pki.server.cert, pki.server.key))
    with pytest.raises(Unavailable):
        model_name(target)


def test_server_cert_not_signed_by_the_ca_is_refused(pki, start_server):
    target = start_server(server_credentials(pki.rogue_server.cert, pki.rogue_server.key))
    with pytest.raises(Unavailable):
        model_name(target, ca_cert=pki.ca.cert)


def test_mtls_accepts_a_client_cert_signed_by_the_ca(pki, start_server):
    target = start_server(server_credentials(pki.server.cert, pki.server.key, client_ca=pki.ca.cert))
    name = model_name(target, ca_cert=pki.ca.cert, client_cert=pki.client.cert, client_key=pki.client.key)
    assert name == "secure-model"


@pytest.mark.parametrize("client_identity", [None, "rogue"])
def test_mtls_refuses_a_client_without_the_right_cert(pki, start_server, client_identity):
    target = start_server(server_credentials(pki.server.cert, pki.server.key, client_ca=pki.ca.cert))
    identity = {}
    if client_identity == "rogue":
        identity = {"client_cert": pki.rogue_client.cert, "client_key": pki.rogue_client.key}
    # The handshake fails; depending on TLS version the client sees it at once or on its first read.
    with pytest.raises(Unavailable):
        model_name(target, ca_cert=pki.ca.cert, **identity)


# --- bearer tokens ---


def test_right_token_is_accepted(start_server):
    target = start_server(token=TOKEN)
    assert model_name(target, auth_token=TOKEN) == "secure-model"
    with TandemClient(target, auth_token=TOKEN, timeout=SAFETY_TIMEOUT) as client:
        assert client.complete("echo").text == "echo"


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1]])
def test_missing_or_wrong_token_is_unauthenticated(start_server, token):
    target = start_server(token=TOKEN)
    with TandemClient(target, auth_token=token, timeout=SAFETY_TIMEOUT) as client:
        with pytest.raises(Unauthenticated) as unary:
            client.model_info()
        with pytest.raises(Unauthenticated):
            client.complete("echo")
    assert "bearer token" in unary.value.message


@pytest.mark.parametrize("header", [f"Basic {TOKEN}", TOKEN, f"bearer {TOKEN}"])
def test_only_the_bearer_scheme_counts(start_server, header):
    target = start_server(token=TOKEN)
    with TandemClient(target, timeout=SAFETY_TIMEOUT) as client:
        if header.lower().startswith("bearer "):
            assert client.model_info(metadata={"authorization": header}).model_name == "secure-model"
        else:
            with pytest.raises(Unauthenticated):
                client.model_info(metadata={"authorization": header})


def test_health_and_reflection_answer_without_a_token(start_server):
    target = start_server(token=TOKEN)
    with TandemClient(target, timeout=SAFETY_TIMEOUT) as client:
        assert client.health() == "SERVING"
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=SAFETY_TIMEOUT))
    assert GENERATION_SERVICE in {s.name for s in response.list_services_response.service}


def test_token_and_mtls_together(pki, start_server):
    target = start_server(server_credentials(pki.server.cert, pki.server.key, client_ca=pki.ca.cert), TOKEN)
    identity = {"ca_cert": pki.ca.cert, "client_cert": pki.client.cert, "client_key": pki.client.key}
    assert model_name(target, auth_token=TOKEN, **identity) == "secure-model"
    with pytest.raises(Unauthenticated):
        model_name(target, **identity)


def test_several_tokens_allow_rotation(start_server):
    target = start_server(token=["old", "new"])
    assert model_name(target, auth_token="old") == model_name(target, auth_token="new") == "secure-model"
    with pytest.raises(Unauthenticated):
        model_name(target, auth_token="other")


@pytest.mark.parametrize("token", ["", [], ["ok", ""]])
def test_empty_tokens_are_refused(token):
    with pytest.raises(CredentialsError):
        BearerTokenInterceptor(token)


# --- loading credentials and tokens ---


def test_load_auth_token_prefers_the_file_then_the_environment(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-env")
    assert load_auth_token(token_file) == TOKEN
    assert load_auth_token() == "from-env"
    monkeypatch.delenv(AUTH_TOKEN_ENV)
    assert load_auth_token() is None
    monkeypatch.setenv(AUTH_TOKEN_ENV, "  ")
    assert load_auth_token() is None


def test_unreadable_or_empty_token_file_is_an_error(tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(CredentialsError, match="empty"):
        load_auth_token(tmp_path / "empty")
    with pytest.raises(CredentialsError, match="cannot read"):
        load_auth_token(tmp_path / "missing")


def test_bad_credential_files_fail_with_clear_messages(pki, tmp_path):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(CredentialsError, match="not PEM"):
        channel_credentials(not_pem)
    with pytest.raises(CredentialsError, match="cannot read the server certificate"):
        server_credentials(tmp_path / "missing.pem", pki.server.key)
    with pytest.raises(CredentialsError, match="together"):
        channel_credentials(pki.ca.cert, cert=pki.client.cert)
