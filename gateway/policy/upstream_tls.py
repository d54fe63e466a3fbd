"""The TLS context of an ``https://`` upstream: the CAs its certificate is verified against
(``ca_file``, else the system's) and the certificate the gateway presents (``client_cert``).

``gateway check`` builds it as ``run`` does, so a missing file or a key that does not match its
certificate is refused with the policy's line, not found on the first request.
"""

from __future__ import annotations

import ssl

from gateway.policy.models import Upstream

TLS_FILES = ("ca_file", "client_cert", "client_key")


def client_context(upstream: Upstream) -> ssl.SSLContext:
    """Raises ``OSError`` (a file) or ``ssl.SSLError`` (its contents)."""
    context = ssl.create_default_context(cafile=upstream.ca_file)
    if upstream.client_cert:
        context.load_cert_chain(upstream.client_cert, upstream.client_key)
    return context


def tls_problem(upstream: Upstream) -> tuple[str, str] | None:
    """The setting whose file cannot be used, and why; None when the context builds."""
    for setting in TLS_FILES:
        path = getattr(upstream, setting)
        if path:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                return setting, f"cannot read {path}: {(exc.strerror or str(exc)).lower()}"
    if upstream.ca_file:
        try:
            ssl.create_default_context(cafile=upstream.ca_file)
        except ssl.SSLError as exc:
            return "ca_file", f"{upstream.ca_file} holds no PEM CA certificate ({exc.reason})"
    if upstream.client_cert:
        try:
            client_context(upstream)
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                reason = "the key does not belong to this certificate"
            else:
                reason = f"not a PEM certificate and key ({exc.reason})"
            return "client_cert", f"{upstream.client_cert}: {reason}"
    return None
