"""The test suite's own layout: what several test files share lives in ``tests/support/``, so no
test file (nor conftest.py, nor a support module) imports a test file or conftest.py; pytest
would import such a module twice, under two names, with two copies of its state."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(dotted: str) -> bool:
    """``tests.test_x``, ``tests.conftest``, or ``test_x`` (tests/ is on ``sys.path`` too);
    not another package's ``test_utils``."""
    package, _, last = dotted.rpartition(".")
    return package in ("", "tests") and (last.startswith("test_") or last == "conftest")


def imported_test_modules(path: Path) -> list[str]:
    """The test modules (``test_*``, ``conftest``) that the file at ``path`` imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if _is_test_module(module):
                found.append(module)
            elif module in ("tests", "") or node.level > 0:
                # ``from tests import test_x`` or ``from . import test_x``
                found += [
                    f"{module}.{alias.name}".lstrip(".")
                    for alias in node.names
                    if _is_test_module(alias.name)
                ]
    return found


def test_no_test_file_imports_another() -> None:
    offenders = {
        str(path.relative_to(TESTS)): imported
        for path in sorted(TESTS.rglob("*.py"))
        if "fixtures" not in path.parts and (imported := imported_test_modules(path))
    }
    assert offenders == {}, "move what they share into tests/support/"


def test_the_check_sees_each_way_of_importing_a_test_file(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import tests.test_a\n"
        "from tests import test_b, support\n"
        "from tests.test_c import helper\n"
        "from tests.conftest import fixture\n"
        "from . import test_d\n"
        "from tests.support.waiting import wait_until\n"
        "from aiohttp.test_utils import RawTestServer\n"
        "import test_e\n"
    )
    assert imported_test_modules(sample) == [
        "tests.test_a",
        "tests.test_b",
        "tests.test_c",
        "tests.conftest",
        "test_d",
        "test_e",
    ]
