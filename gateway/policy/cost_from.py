"""``cost_from:``, what a limit reads a response's cost from in its body: the presets, and a
policy's text checked and split into the paths it sums (``limits/usage.py`` reads them)."""

from __future__ import annotations

import re
from typing import Final

# What an accepted value is: a JSON integer of at most this many digits.
MAX_DIGITS: Final = 18
_PATH_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")

# The presets: the paths of a non-streamed body, and which stream events carry them.
OPENAI: Final = "openai"
ANTHROPIC: Final = "anthropic"
PRESETS: Final = {
    # Chat completions and the Responses API both say ``usage.total_tokens``; streamed with
    # ``stream_options: {include_usage: true}`` the last chunk before ``[DONE]`` carries it.
    OPENAI: "usage.total_tokens",
    # Messages: input and output; streamed, ``message_start`` says the input (in
    # ``message.usage``) and each ``message_delta`` the output so far (in ``usage``).
    ANTHROPIC: "usage.input_tokens + usage.output_tokens",
}


def json_at(document: object, path: tuple[str, ...] | list[str]) -> object:
    """The value at ``path`` (dotted, split) in a parsed JSON document; None when absent. A
    number in the path indexes a list."""
    node = document
    for step in path:
        if isinstance(node, dict):
            node = node.get(step)
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return None
    return node


class BadCostFrom(ValueError):
    """A ``cost_from`` the policy cannot use: the reason, in the policy's words."""


def parse_cost_from(text: str) -> tuple[tuple[str, ...], ...]:
    """The paths ``text`` sums, each split at its dots (a preset: its own)."""
    expression = PRESETS.get(text.strip(), text)
    terms = [term.strip() for term in expression.split("+")]
    for term in terms:
        if not _PATH_RE.match(term):
            raise BadCostFrom(
                f"cost_from {text!r}: {term!r} is not a path; write a preset (openai, "
                "anthropic), a dotted path (usage.total_tokens) or a sum of them "
                "(usage.prompt_tokens + usage.completion_tokens)"
            )
    return tuple(tuple(term.split(".")) for term in terms)
