"""The Dockerfile read as instructions: no Docker engine runs on the build machines, so the
packaging and deployment tests parse it."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(KEYWORD, rest) per instruction, continuation lines joined, comments left out."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    """The instructions from the last ``FROM`` on: what the shipped image is built from."""
    instructions = dockerfile_instructions()
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def dockerfile_env() -> dict[str, str]:
    """The final stage's ENV settings (``ENV A=1 B=2`` form)."""
    env: dict[str, str] = {}
    for keyword, rest in final_stage():
        if keyword == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    return env
