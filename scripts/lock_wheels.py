"""Prove requirements.lock on every platform the image is built for, and record how.

    python scripts/lock_wheels.py            # after regenerating requirements.lock

For each platform (CPython 3.11 on glibc Linux, x86_64 and aarch64: the python:3.11-slim
image's), runs ``pip download --require-hashes --only-binary=:all:`` over the lock, as the
image build's ``pip wheel --require-hashes`` would there, and writes the wheel pip chose for
each package, with its sha256, to requirements.wheels. A lock that lacks a platform's wheel (or
its hash) fails here, and tests/test_packaging.py checks the record against the lock offline.
No musl platform: the image is Debian's.

Needs the package index (this is the one step that does).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
RECORD = ROOT / "requirements.wheels"
# Debian bookworm's glibc is 2.36: every manylinux wheel up to it installs there.
GLIBC_MINORS = range(17, 37)
PLATFORMS = ("x86_64", "aarch64")

HEADER = """\
# The wheel pip installs from requirements.lock for each package on each platform the image is
# built for (CPython 3.11, glibc Linux), with its sha256: written by scripts/lock_wheels.py,
# which downloads them with --require-hashes (so the lock holds on both), and checked against
# the lock by tests/test_packaging.py. Regenerate it with the lock.
# platform file sha256
"""


def platform_options(arch: str) -> list[str]:
    tags = [f"manylinux_2_{minor}_{arch}" for minor in GLIBC_MINORS] + [f"manylinux2014_{arch}"]
    if arch == "x86_64":
        tags += ["manylinux2010_x86_64", "manylinux1_x86_64"]
    return [option for tag in tags for option in ("--platform", tag)]


def download(arch: str, into: Path) -> list[tuple[str, str]]:
    subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--require-hashes", "--only-binary=:all:", *platform_options(arch),
            "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            "-r", str(LOCK), "-d", str(into),
        ],
        check=True,
    )  # fmt: skip
    return sorted(
        (wheel.name, hashlib.sha256(wheel.read_bytes()).hexdigest()) for wheel in into.glob("*.whl")
    )


def main() -> None:
    lines = []
    for arch in PLATFORMS:
        with tempfile.TemporaryDirectory() as directory:
            for name, digest in download(arch, Path(directory)):
                lines.append(f"linux-{arch} {name} {digest}\n")
    RECORD.write_text(HEADER + "".join(lines))
    print(f"wrote {RECORD}: {len(lines)} wheels")


if __name__ == "__main__":
    main()
