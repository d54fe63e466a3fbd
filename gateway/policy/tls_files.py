"""A TLS listener's certificates and keys: read from their PEM files, checked, made into contexts.

What ``gateway check``, ``gateway run`` and a reload all refuse, each in one line: a file that
cannot be read, a key that is not the certificate's, a certificate already expired. The expiry
date is read from the certificate itself (its DER ``notAfter``), for the metrics and their alert.
"""

from __future__ import annotations

import calendar
import os
import re
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gateway.policy.models import Certificate, ServerSettings, TlsSettings
from gateway.policy.overrides_file import resolve_path

_PEM_CERT_RE: Final = re.compile(
    r"-----BEGIN CERTIFICATE-----\s*.+?-----END CERTIFICATE-----", re.DOTALL
)
_VERSIONS: Final = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
ALPN_PROTOCOLS: Final = ["http/1.1"]


class TlsFilesError(ValueError):
    """A certificate and key the listener cannot use; ``str()`` is one line naming the file.
    ``index``: which of the settings' ``certificates`` (None for ``cert`` and ``key``)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True, slots=True)
class TlsPair:
    """A loaded certificate and key: the context that serves them, and when the certificate
    expires (Unix time)."""

    context: ssl.SSLContext
    not_after: float
    cert: Path
    key: Path


def certificate_paths(certificate: Certificate, policy_file: str) -> tuple[Path, Path]:
    """The certificate's and the key's paths (relative names: to the policy file's directory)."""
    return resolve_path(policy_file, certificate.cert), resolve_path(policy_file, certificate.key)


def listener_tls_loc(
    server: ServerSettings, listener: int, certificate: int | None
) -> tuple[str | int, ...]:
    """Where a listener's certificate is in the policy file: ``server.tls`` for the one listen
    address, ``server.listen[N].tls`` in a list; then ``certificates[M]`` when it names several."""
    loc: tuple[str | int, ...] = (
        ("server", "tls")
        if isinstance(server.listen, str)
        else ("server", "listen", listener, "tls")
    )
    return loc if certificate is None else (*loc, "certificates", certificate)


def file_signature(paths: tuple[Path, ...]) -> tuple[tuple[int, int, int] | None, ...]:
    """What changes when a file is rewritten or its symlink swapped (cert-manager, a Secret)."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            stat = os.stat(path)
        except OSError:
            out.append(None)
        else:
            out.append((stat.st_mtime_ns, stat.st_size, stat.st_ino))
    return tuple(out)


def load_tls(
    settings: TlsSettings, policy_file: str, now: float | None = None
) -> tuple[TlsPair, ...]:
    """Every certificate of ``settings`` loaded, in their order; ``TlsFilesError`` (with the
    certificate's index) for the first that does not load."""
    pairs: list[TlsPair] = []
    for index, certificate in enumerate(settings.chain_files):
        try:
            pairs.append(load_pair(certificate, settings, policy_file, now))
        except TlsFilesError as exc:
            raise TlsFilesError(str(exc), index if settings.certificates else None) from None
    return tuple(pairs)


def load_pair(
    certificate: Certificate, settings: TlsSettings, policy_file: str, now: float | None = None
) -> TlsPair:
    """A server context with one pair loaded (TLS ``min_version``+, ALPN http/1.1), or
    ``TlsFilesError``."""
    cert, key = certificate_paths(certificate, policy_file)
    try:
        pem = cert.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise TlsFilesError(f"{cert}: cannot read: {exc.strerror}") from None
    match = _PEM_CERT_RE.search(pem)
    if match is None:
        raise TlsFilesError(f"{cert}: no PEM certificate in it (-----BEGIN CERTIFICATE-----)")
    try:
        not_after = certificate_not_after(ssl.PEM_cert_to_DER_cert(match.group(0)))
    except ValueError as exc:
        raise TlsFilesError(f"{cert}: unreadable certificate: {exc}") from None
    now = time.time() if now is None else now
    if not_after <= now:
        expired = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(not_after))
        raise TlsFilesError(f"{cert}: the certificate expired on {expired}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS[settings.min_version]
    context.set_alpn_protocols(ALPN_PROTOCOLS)
    try:
        context.load_cert_chain(cert, key)
    except OSError as exc:
        if isinstance(exc, ssl.SSLError):
            if "KEY_VALUES_MISMATCH" in str(exc):
                raise TlsFilesError(f"{key}: this key does not belong to {cert}") from None
            raise TlsFilesError(
                f"{cert}, {key}: not a PEM certificate chain and its key ({exc.reason})"
            ) from None
        raise TlsFilesError(f"{exc.filename or key}: cannot read: {exc.strerror}") from None
    return TlsPair(context, not_after, cert, key)


def minimum_version(settings: TlsSettings) -> ssl.TLSVersion:
    return _VERSIONS[settings.min_version]


# -- the few DER steps from a certificate to its notAfter ------------------------------------


def _read(data: bytes, offset: int) -> tuple[int, int, int]:
    """The tag, the content's start and its end of the DER element at ``offset``."""
    if offset + 2 > len(data):
        raise ValueError("truncated DER")
    tag = data[offset]
    length = data[offset + 1]
    start = offset + 2
    if length & 0x80:
        count = length & 0x7F
        if count == 0 or count > 4 or start + count > len(data):
            raise ValueError("bad DER length")
        length = int.from_bytes(data[start : start + count], "big")
        start += count
    end = start + length
    if end > len(data):
        raise ValueError("truncated DER")
    return tag, start, end


def certificate_not_after(der: bytes) -> float:
    """When an X.509 certificate expires (Unix time), from its DER bytes."""
    tag, cert_start, _ = _read(der, 0)  # Certificate
    if tag != 0x30:
        raise ValueError("not a certificate")
    tag, field, _ = _read(der, cert_start)  # TBSCertificate
    if tag != 0x30:
        raise ValueError("not a certificate")
    tag, _, end = _read(der, field)
    if tag == 0xA0:  # [0] version, explicit
        field = end
        tag, _, end = _read(der, field)
    for _ in range(2):  # after the serialNumber: signature, issuer
        field = end
        tag, _, end = _read(der, field)
    tag, validity, _ = _read(der, end)  # Validity
    if tag != 0x30:
        raise ValueError("no validity in the certificate")
    _, _, not_before_end = _read(der, validity)
    tag, start, end = _read(der, not_before_end)
    text = der[start:end].decode("ascii")
    if tag == 0x17:  # UTCTime YYMMDDHHMMSSZ: 50-99 are 19xx (RFC 5280)
        year = int(text[:2])
        text = ("19" if year >= 50 else "20") + text
    elif tag != 0x18:  # GeneralizedTime YYYYMMDDHHMMSSZ
        raise ValueError("no notAfter time in the certificate")
    if not text.endswith("Z") or len(text) != 15:
        raise ValueError(f"unsupported time {text!r}")
    parsed = time.strptime(text, "%Y%m%d%H%M%SZ")
    return float(calendar.timegm(parsed))
