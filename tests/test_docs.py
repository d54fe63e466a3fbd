"""The documentation holds: the site builds with no warning (a broken link or anchor fails), the
README stays short and reaches every page, every policy shown passes ``gateway check``, every
``gateway`` command shown exists with the options shown, the policy reference is what its
generator makes, and the module map and the metrics page name everything there is."""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli.main import build_parser
from gateway.policy.models import Policy

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [README, *PAGES]


@dataclass(frozen=True)
class Block:
    """A fenced block of a Markdown file: its language, text, and the line its text starts on."""

    path: Path
    line: int
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    blocks = []
    lines = path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^\s*```(\w*)\s*$", lines[index])
        if opening is None:
            index += 1
            continue
        start = index + 1
        end = start
        while not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        blocks.append(Block(path, start + 1, opening.group(1), "\n".join(lines[start:end]) + "\n"))
        index = end + 1
    return blocks


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a link to a missing page or anchor, or a page left out of the
    navigation, fails the build."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    home = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert "Your first policy, in five minutes" in home  # the README is the home page


def test_the_readme_is_what_a_new_user_reads() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference into docs/"
    text = "\n".join(lines)
    # Its two commands, exactly.
    assert "\nbash scripts/demo.sh\n" in text
    assert "\nbash scripts/test.sh\n" in text


def _links(path: Path) -> set[Path]:
    """The Markdown files in the repository that ``path`` links to."""
    found = set()
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
        linked = (path.parent / target).resolve()
        if linked.exists():
            found.add(linked)
    return found


def test_every_page_is_reachable_from_the_readme() -> None:
    reached = {README.resolve()}
    todo = [README.resolve()]
    while todo:
        for linked in _links(todo.pop()) - reached:
            reached.add(linked)
            todo.append(linked)
    unreached = [
        page.name for page in PAGES if page.resolve() not in reached and page.name != "index.md"
    ]
    assert unreached == [], "link these pages from README.md (or a page it links to)"


# -- policies shown ------------------------------------------------------------------------------


def _referenced_routes(policy: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for limit in (policy.get("limits") or {}).values():
        if not isinstance(limit, dict):
            continue
        match = limit.get("match") or {}
        names.update(match.get("routes") or ())
        cost = limit.get("cost")
        if isinstance(cost, dict):
            names.update((cost.get("routes") or {}).keys())
    return names


def as_policy_file(block: Block) -> str | None:
    """The block as a whole policy file, or None when it is not a policy. A block whose
    top-level keys are all policy sections is one; a fragment (limits without routes, say) is
    completed with a demo upstream and the routes its limits name."""
    if block.language not in ("yaml", "yml"):
        return None
    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError as exc:
        raise AssertionError(f"{block}: a YAML block that does not parse: {exc}") from None
    if not isinstance(data, dict) or not data or not set(data) <= set(Policy.model_fields):
        return None
    if "upstreams" not in data:
        data["upstreams"] = {"backend": {"url": "builtin:demo"}}
    if "routes" not in data:
        upstream = next(iter(data["upstreams"]))
        routes = sorted(_referenced_routes(data))
        data["routes"] = [{"name": name, "upstream": upstream} for name in routes]
        data["routes"].append({"name": "catch-all", "upstream": upstream})
    return yaml.safe_dump(data, sort_keys=False)


def policy_blocks() -> list[Block]:
    return [block for path in MARKDOWN for block in fenced_blocks(path) if as_policy_file(block)]


def test_the_documentation_shows_policies() -> None:
    """The snippet check below has something to check: the README's and the pages'."""
    sources = {block.path.name for block in policy_blocks()}
    assert {"README.md", "policies.md", "stores.md", "operating.md"} <= sources


@pytest.mark.parametrize("block", policy_blocks(), ids=str)
def test_every_policy_shown_passes_gateway_check(block: Block, tmp_path: Path) -> None:
    text = as_policy_file(block)
    assert text is not None
    # Beside a copy of policies/tiers/, for the tiers example's overrides_file.
    shutil.copytree(ROOT / "policies" / "tiers", tmp_path / "tiers")
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    # A token from the environment, as a deployment gives one: an example's token file (a
    # mounted secret) is not on this machine, and check reads the token as run does.
    env = {**os.environ, "GATEWAY_ADMIN_TOKEN": "a-token-for-the-snippet-check"}
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "check", str(policy)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, f"{block}: {done.stderr}\n{text}"


def test_the_snippet_check_refuses_a_bad_policy(tmp_path: Path) -> None:
    block = Block(README, 1, "yaml", "limits:\n  x:\n    algorithm: leaky_bucket\n    rate: 10\n")
    text = as_policy_file(block)
    assert text is not None and "catch-all" in text
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "check", str(policy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "invalid rate" in done.stderr


# -- commands shown ------------------------------------------------------------------------------


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("gateway has no subcommands")


GLOBAL_OPTIONS = {opt for action in build_parser()._actions for opt in action.option_strings}


def _gateway_commands(text: str) -> list[list[str]]:
    """Every ``gateway ...`` command line in ``text`` (a shell block or an inline code span),
    as words."""
    commands = []
    for line in text.splitlines():
        for segment in re.split(r"\||&&|;|\$\(", line):
            words = segment.replace("[", " ").replace("]", " ").split()
            if words and words[0] in ("gateway", ".venv/bin/gateway"):
                commands.append(words[1:])  # the command word first: not `ruff check gateway`
            elif words[:3] in (["python", "-m", "gateway"], ["python3", "-m", "gateway"]):
                commands.append(words[3:])
    return commands


def shown_gateway_commands() -> list[tuple[str, list[str]]]:
    shown = []
    for path in MARKDOWN:
        text = path.read_text(encoding="utf-8")
        sources = [b.text for b in fenced_blocks(path) if b.language in ("sh", "bash", "")]
        sources += re.findall(r"`((?:\.venv/bin/)?gateway [^`]+)`", text)
        for source in sources:
            for words in _gateway_commands(source):
                shown.append((path.name, words))
    return shown


def test_every_gateway_command_shown_exists() -> None:
    subcommands = _subcommands()
    wrong = []
    shown = shown_gateway_commands()
    assert len(shown) > 20
    for page, words in shown:
        if not words or words[0] in ("...", "--help"):
            continue
        if words[0].startswith("-"):  # options before the subcommand
            unknown = [w for w in words if w.startswith("--") and w not in GLOBAL_OPTIONS]
            wrong += [f"{page}: gateway {' '.join(words)}: {w}" for w in unknown]
            continue
        if words[0] not in subcommands:
            if re.fullmatch(r"[a-z]+", words[0]):  # a word, not a subcommand: prose
                wrong.append(f"{page}: gateway {' '.join(words)}: no subcommand {words[0]!r}")
            continue
        known = GLOBAL_OPTIONS | {
            opt for action in subcommands[words[0]]._actions for opt in action.option_strings
        }
        for word in words[1:]:
            option = word.split("=", 1)[0]
            if option.startswith("--") and option.strip(".,") not in known:
                wrong.append(f"{page}: gateway {' '.join(words)}: unknown option {option}")
    assert wrong == []


def test_the_command_check_sees_a_wrong_command() -> None:
    commands = _gateway_commands("gateway run --config x.yaml --nope && gateway chek x")
    assert commands == [["run", "--config", "x.yaml", "--nope"], ["chek", "x"]]
    assert _gateway_commands("ruff check gateway tests") == []


SCRIPT_COMMAND = re.compile(r"(?:python3?|bash) ((?:bench|scripts|docs)/[\w./-]+)([^`\n]*)")


def test_every_script_shown_exists_with_its_options() -> None:
    """``python bench/x.py --opt``, ``bash scripts/x.sh``: the file exists and names the
    option."""
    wrong = []
    for path in [*MARKDOWN, ROOT / "bench" / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for match in SCRIPT_COMMAND.finditer(text):
            script = ROOT / match.group(1)
            if not script.is_file():
                wrong.append(f"{path.name}: {match.group(1)} does not exist")
                continue
            source = script.read_text(encoding="utf-8")
            for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", match.group(2)):
                if f'"{option}"' not in source and f"'{option}'" not in source:
                    wrong.append(f"{path.name}: {match.group(1)} has no option {option}")
    assert wrong == []


# -- generated and complete ---------------------------------------------------------------------


def test_the_policy_reference_is_what_its_generator_makes() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/policy_reference.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    committed = (DOCS / "policy-reference.md").read_text(encoding="utf-8")
    assert done.stdout == committed, (
        "run `python scripts/policy_reference.py > docs/policy-reference.md`"
    )


def test_the_module_map_names_every_module() -> None:
    architecture = (DOCS / "architecture.md").read_text(encoding="utf-8")
    gateway = ROOT / "gateway"
    missing = []
    for module in sorted(gateway.rglob("*.py")):
        name = module.relative_to(gateway).as_posix()
        if module.name == "__init__.py" and module.parent != gateway:
            name = module.parent.relative_to(gateway).as_posix() + "/"
        if f"`{name}`" not in architecture:
            missing.append(name)
    assert missing == [], "add them to docs/architecture.md"


def test_the_metrics_page_names_every_metric() -> None:
    page = (DOCS / "observability.md").read_text(encoding="utf-8")
    names: set[str] = set()
    for module in (ROOT / "gateway" / "observability").glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"(gateway|process)_[a-z0-9_]+", node.value)
            ):
                names.add(node.value)
    assert len(names) > 30
    missing = sorted(n for n in names if not re.search(rf"`{n}(_total)?`", page))
    assert missing == [], "add them to docs/observability.md"


def _logger_names() -> set[str]:
    """The names the code gives its loggers (``logging.getLogger("gateway....")``)."""
    names: set[str] = set()
    for module in (ROOT / "gateway").rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.add(node.args[0].value)
    return names


def test_every_logger_the_pages_name_exists() -> None:
    """``logger `gateway.x``` and ``loggers `gateway.x` and `gateway.y```: an operator filters
    the log on these names, so each must be a logger the code writes on."""
    named: set[str] = set()
    for path in MARKDOWN:
        text = path.read_text(encoding="utf-8")
        for phrase in re.findall(r"loggers? ((?:`gateway[\w.]*`(?: and | or |, )?)+)", text):
            named.update(re.findall(r"`(gateway[\w.]*)`", phrase))
    assert {"gateway.access", "gateway.limits", "gateway.upstream"} <= named
    assert sorted(named - _logger_names()) == [], "the code has no logger of these names"
