"""The README's scripts besides the two commands, run for real: the operator's short check
(scripts/smoke.sh) and the documentation site (scripts/docs.sh); and what the first command
shows while the compiled build takes its minutes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def script_env(**extra: str) -> dict[str, str]:
    """The scripts' virtual environment is the one running the tests (nothing is installed
    where it is already: no download)."""
    env = {**os.environ, "VIRTUAL_ENV": sys.prefix, "PYTHON": sys.executable, **extra}
    for name in ("GATEWAY_LISTEN", "GATEWAY_ADMIN_LISTEN", "GATEWAY_ADMIN_TOKEN"):
        env.pop(name, None)
    return env


def test_the_operators_short_check_checks_every_example_and_runs_one() -> None:
    done = subprocess.run(
        ["bash", "scripts/smoke.sh"],
        cwd=ROOT,
        env=script_env(GATEWAY=f"{sys.executable} -m gateway"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for policy in sorted((ROOT / "policies").glob("*.yaml")):
        if policy.name.endswith(".tests.yaml"):  # a policy's test cases, run with it
            assert f"policies/{policy.name}: the policy's tests" in done.stdout
            policy_file = policy.name.removesuffix(".tests.yaml") + ".yaml"
            said = f"policies/{policy.name}: the test cases of policies/{policy_file}, run with it"
            assert said in done.stdout
        else:
            assert f"policies/{policy.name}: ok (sha256 " in done.stdout
    assert "6 logins in a minute (limit login: 5): [200, 200, 200, 200, 200, 429]" in done.stdout
    assert done.stdout.rstrip().endswith("smoke: stopped on SIGTERM, exit 0; ok")


def test_the_short_check_fails_on_a_policy_that_does_not_check(tmp_path: Path) -> None:
    """It stops at `gateway check`, with its line, before running anything."""
    failing = tmp_path / "gateway"
    failing.write_text(
        f'#!/bin/sh\nif [ "$1" = check ]; then echo "x.yaml:1: broken" >&2; exit 1; fi\n'
        f'exec {sys.executable} -m gateway "$@"\n'
    )
    failing.chmod(0o755)
    done = subprocess.run(
        ["bash", "scripts/smoke.sh"],
        cwd=ROOT,
        env=script_env(GATEWAY=str(failing)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "x.yaml:1: broken" in done.stderr and "serving on" not in done.stdout


def test_the_docs_build_with_one_command_that_installs_what_it_needs(tmp_path: Path) -> None:
    script = (ROOT / "scripts" / "docs.sh").read_text()
    assert "pip install" in script and "mkdocs build --strict" in script
    done = subprocess.run(
        ["bash", "scripts/docs.sh", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "operating" / "index.html").is_file()
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/docs.sh" in readme and "bash scripts/smoke.sh" in readme


def test_the_first_command_shows_the_compiled_builds_progress() -> None:
    """pip hides a build's output unless -v: demo.sh builds with -v and shows setup.py's
    progress lines (``gateway build: ...``, one per C file), and says how long it takes."""
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert re.search(r"pip install -v .*'\.\[speed\]'", demo)
    assert "gateway build: " in demo
    setup = (ROOT / "setup.py").read_text()
    assert 'print(f"gateway build: {message}", file=sys.stderr' in setup
    assert 'say(f"[{next(count)}/{total}] compiling' in setup
    assert '"build_ext": BuildExtWithProgress' in setup
    readme = (ROOT / "README.md").read_text()
    assert "three minutes" in readme and "GATEWAY_PURE_PYTHON=1 bash scripts/demo.sh" in readme
