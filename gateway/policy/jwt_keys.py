"""The keys tokens are verified with: a secret or a PEM file read and checked as ``run``
builds them (so ``gateway check`` refuses what a start would), and a JSON Web Key Set's keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from joserfc.jwk import ECKey, OctKey, OKPKey, RSAKey

from gateway.policy.identity import JwtSettings

Key = OctKey | RSAKey | ECKey | OKPKey
_PUBLIC_KEY_TYPES: Final = (RSAKey, ECKey, OKPKey)
# An HMAC secret shorter than this is guessable offline from one token (RFC 7518 3.2).
MIN_SECRET_BYTES: Final = 32


class KeyFileError(ValueError):
    """A key file that cannot be used: ``setting`` names it in the policy."""

    def __init__(self, setting: str, reason: str) -> None:
        super().__init__(reason)
        self.setting = setting
        self.reason = reason


def load_static_key(settings: JwtSettings) -> Key | None:
    """The key of ``secret_file`` or ``public_key_file`` (``None`` for ``jwks_url``)."""
    if settings.secret_file is not None:
        data = _read("secret_file", settings.secret_file).strip()
        if len(data) < MIN_SECRET_BYTES:
            raise KeyFileError(
                "secret_file",
                f"the secret is {len(data)} bytes: HS256 needs at least {MIN_SECRET_BYTES}",
            )
        return OctKey.import_key(data)
    if settings.public_key_file is not None:
        data = _read("public_key_file", settings.public_key_file)
        if b"PRIVATE KEY" in data:
            raise KeyFileError(
                "public_key_file",
                "holds a private key: give the gateway the public key only",
            )
        for key_type in _PUBLIC_KEY_TYPES:
            try:
                return key_type.import_key(data)
            except Exception:
                continue
        raise KeyFileError(
            "public_key_file", "not a PEM public key (RSA, EC or Ed25519): BEGIN PUBLIC KEY"
        )
    return None


def _read(setting: str, name: str) -> bytes:
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise KeyFileError(setting, f"cannot read {name}: {exc.strerror or exc}") from None


def key_set_of(document: Any) -> dict[str, Key]:
    """A JWKS document's public signing keys by ``kid``; keys without a kid, private or
    symmetric keys, and keys for encryption only are left out. ValueError if it is no JWKS."""
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError("not a JSON Web Key Set: expected an object with a 'keys' list")
    keys: dict[str, Key] = {}
    for entry in document["keys"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("kid"), str):
            continue
        if entry.get("use", "sig") != "sig" or "d" in entry or entry.get("kty") == "oct":
            continue
        kty = entry.get("kty")
        try:
            if kty == "RSA":
                keys[entry["kid"]] = RSAKey.import_key(entry)
            elif kty == "EC":
                keys[entry["kid"]] = ECKey.import_key(entry)
            elif kty == "OKP":
                keys[entry["kid"]] = OKPKey.import_key(entry)
        except Exception:
            continue
    return keys
