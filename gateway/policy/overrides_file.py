"""A limit's ``overrides_file``: a table of key value -> plan (or parameters) kept beside the
policy, so that it can be generated (from a customer database, say) and reloaded on its own.

JSON (an object) and YAML (a mapping) are read. A YAML file of plain ``value: plan`` lines, the
form a generator writes, is read line by line: PyYAML takes seconds over 100,000 lines, this a
fraction of one (bench/README.md). Errors name the file and line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

# One ``value: plan`` line: a plain or double-quoted value without quotes, '#' or ': ' in it.
_LINE_RE = re.compile(
    r'^(?:"(?P<quoted>[^"\\]*)"|(?P<plain>[^\s"\'#{}\[\],&*!|>%@`][^\s#]*?))'
    r":[ \t]+(?P<plan>[A-Za-z0-9][A-Za-z0-9_.\-]*)[ \t]*(?:#.*)?$"
)


# The same, over a whole file at once: a few times faster than a loop over its lines.
_ALL_LINES_RE = re.compile(
    r'^(?:"([^"\\\n]*)"|([^\s"\'#{}\[\],&*!|>%@`][^\s#]*?))'
    r":[ \t]+([A-Za-z0-9][A-Za-z0-9_.\-]*)[ \t]*(?:#[^\n]*)?$",
    re.MULTILINE,
)


# Lines that hold no entry: blank, a comment, a document start.
_IGNORED_RE = re.compile(r"^[ \t]*(?:#[^\n]*|---[ \t]*)?$", re.MULTILINE)


class OverridesFileError(ValueError):
    """A problem in an overrides file, with its line when known."""

    def __init__(self, file: str, line: int | None, reason: str) -> None:
        self.file = file
        self.line = line
        self.reason = reason
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {reason}")


def resolve_path(policy_file: str, name: str) -> Path:
    """``name`` relative to the policy file's directory (absolute names as they are)."""
    path = Path(name)
    return path if path.is_absolute() else Path(policy_file).parent / path


def read_overrides(path: Path) -> tuple[dict[str, Any], str]:
    """The file's entries and its text (for the policy's digest)."""
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise OverridesFileError(file, None, f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise OverridesFileError(file, None, "not valid UTF-8") from None
    if path.suffix == ".json":
        return _json(text, file), text
    simple = _simple_lines(text, file)
    return (simple if simple is not None else _yaml(text, file)), text


def line_of(text: str, value: str) -> int | None:
    """The line where an entry's value is written (for errors found after parsing)."""
    for candidate in (f'"{value}"', value):
        at = text.find(candidate)
        while at != -1:
            if at == 0 or text[at - 1] in "\n \t{,":
                return text.count("\n", 0, at) + 1
            at = text.find(candidate, at + 1)
    return None


def _simple_lines(text: str, file: str) -> dict[str, Any] | None:
    found = _ALL_LINES_RE.findall(text)
    lines = text.count("\n") + 1  # the last, maybe empty, line counts in both
    meaningful = lines - len(_IGNORED_RE.findall(text))
    if len(found) != meaningful:
        return None  # not the simple form throughout: YAML decides
    entries = {quoted or plain: plan for quoted, plain, plan in found}
    if len(entries) != len(found):
        seen: set[str] = set()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = _LINE_RE.match(raw)
            if line is None:
                continue
            value = line.group("quoted") or line.group("plain")
            if value in seen:
                raise OverridesFileError(file, number, f"duplicate key {value!r}")
            seen.add(value)
    return entries


def _json(text: str, file: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OverridesFileError(file, exc.lineno, f"invalid JSON: {exc.msg}") from None
    return _checked(data, text, file)


def _yaml(text: str, file: str) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(text, Loader=loader)  # a safe loader: plain data only
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise OverridesFileError(
            file, line, f"invalid YAML: {exc.problem or exc.context}"
        ) from None
    except yaml.YAMLError as exc:
        raise OverridesFileError(file, None, f"invalid YAML: {exc}") from None
    return _checked(data, text, file)


def _checked(data: Any, text: str, file: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OverridesFileError(file, 1, "expected a mapping of key value -> plan or parameters")
    for value, target in data.items():
        if not isinstance(value, str):
            raise OverridesFileError(
                file, line_of(text, str(value)), f"key {value!r} must be a string (quote it)"
            )
        if not isinstance(target, str | dict):
            raise OverridesFileError(
                file,
                line_of(text, value),
                f"{value!r}: expected a plan's name or a mapping of parameters",
            )
    return data
