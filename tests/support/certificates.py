"""Throwaway certificates made by openssl: a CA, a server certificate it signed for 127.0.0.1
and a client certificate it signed, for TLS upstreams (mutual TLS included)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TLSFiles:
    """A throwaway CA, a server certificate it signed for 127.0.0.1, and a client certificate
    it signed (CN ``gateway-client``), each with its key, made by openssl."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TLSFiles:
    def openssl(*args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60
        )

    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-days", "1", "-subj", "/CN=test CA", "-keyout", "ca.key", "-out", "ca.pem",
    )  # fmt: skip
    (directory / "server.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    (directory / "client.cnf").write_text("extendedKeyUsage=clientAuth\n")
    for name, subject in (("server", "/CN=127.0.0.1"), ("client", "/CN=gateway-client")):
        openssl(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-subj", subject, "-keyout", f"{name}.key", "-out", f"{name}.csr",
        )  # fmt: skip
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", f"{name}.cnf", "-out", f"{name}.pem",
        )  # fmt: skip
    return TLSFiles(
        directory / "ca.pem",
        directory / "server.pem",
        directory / "server.key",
        directory / "client.pem",
        directory / "client.key",
    )


def make_named_certificate(
    directory: Path, files: TLSFiles, stem: str, names: tuple[str, ...]
) -> tuple[Path, Path]:
    """A server certificate signed by ``files.ca`` for the DNS ``names`` (and 127.0.0.1),
    with its key: ``stem.pem``, ``stem.key``. A client that trusts the CA and checks the host
    name accepts it for those names only, so a handshake that verifies names the certificate
    served."""
    sans = ",".join([*(f"DNS:{name}" for name in names), "IP:127.0.0.1"])
    (directory / f"{stem}.cnf").write_text(f"subjectAltName={sans}\n")

    def openssl(*args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60
        )

    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-subj", f"/CN={names[0] if names else stem}", "-keyout", f"{stem}.key",
        "-out", f"{stem}.csr",
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", f"{stem}.csr", "-CA", str(files.ca),
        "-CAkey", str(files.ca.with_suffix(".key")), "-CAcreateserial", "-days", "1",
        "-extfile", f"{stem}.cnf", "-out", f"{stem}.pem",
    )  # fmt: skip
    return directory / f"{stem}.pem", directory / f"{stem}.key"
