"""The build under test: compiled (mypyc) or pure Python, never a silent mix; both decide alike.

``scripts/test.sh`` sets ``GATEWAY_EXPECT_BUILD`` (``compiled`` or ``pure Python``) for each of
its two runs, so a compiled build that failed to load, or an in-place build older than its
sources, fails here rather than passing on pure Python.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from gateway.build import COMPILED_MODULES, build_name, compiled_modules
from tests.support.processes import REPO_ROOT

EXPECTED = os.environ.get("GATEWAY_EXPECT_BUILD")


def test_the_build_expected_is_the_one_imported() -> None:
    if EXPECTED is None:
        pytest.skip("GATEWAY_EXPECT_BUILD is not set (scripts/test.sh sets it)")
    assert EXPECTED in ("compiled", "pure Python")
    loaded = {name: importlib.import_module(name) for name in COMPILED_MODULES}
    from_extensions = sorted(
        name
        for name, module in loaded.items()
        if str(module.__file__).endswith(tuple(EXTENSION_SUFFIXES))
    )
    if EXPECTED == "compiled":
        assert from_extensions == sorted(COMPILED_MODULES)
    else:
        assert from_extensions == []
    assert build_name() == EXPECTED


def test_a_spawned_gateway_runs_the_same_build() -> None:
    """Tests spawn ``python -m gateway`` from the repository root: it must load what the tests
    import, and say so."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--version"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip().endswith(f"({build_name()})")


def test_no_compiled_module_is_older_than_its_source() -> None:
    """An in-place build (``pip install -e .``) is not rebuilt when a source changes: a stale
    one would test old code."""
    compiled = compiled_modules()
    if not compiled:
        return
    # A module's own .so is a shim, left as it was when only the code changed; the code is in
    # the one shared library (``gateway__mypyc``), rebuilt whenever any module is.
    library = importlib.util.find_spec("gateway__mypyc")
    assert library is not None and library.origin is not None
    built = Path(library.origin).stat().st_mtime
    stale = []
    for name in compiled:
        source = REPO_ROOT / Path(*name.split(".")).with_suffix(".py")
        if source.exists() and source.stat().st_mtime > built:
            stale.append(name)
    assert stale == [], "rebuild: pip install -e . (or delete the .so files for pure Python)"


def test_no_compiled_function_binds_one_name_in_except_clauses_of_different_types() -> None:
    """Compiled, ``except A as exc: ... except B as exc:`` gives ``exc`` the type ``A`` and
    fails with ``TypeError`` when ``B`` is caught (mypyc 2.4): one name per type."""
    found = []
    for name in COMPILED_MODULES:
        path = REPO_ROOT / Path(*name.split(".")).with_suffix(".py")
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            types: dict[str, set[str]] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    types.setdefault(node.name, set()).add(ast.unparse(node.type))
            found += [f"{name}.{function.name}: {n}" for n, t in types.items() if len(t) > 1]
    assert found == []


def _reads_the_exception_after_an_await(handler: ast.ExceptHandler) -> bool:
    """Whether a statement of ``handler`` after one that awaits re-raises (bare ``raise``) or
    reads the exception's name."""
    awaited = False
    for statement in handler.body:
        nodes = list(ast.walk(statement))
        if awaited and any(
            (isinstance(node, ast.Raise) and node.exc is None)
            or (isinstance(node, ast.Name) and handler.name is not None and node.id == handler.name)
            for node in nodes
        ):
            return True
        awaited = awaited or any(
            isinstance(node, ast.Await | ast.AsyncFor | ast.AsyncWith) for node in nodes
        )
    return False


def test_no_compiled_coroutine_reraises_after_awaiting_in_an_except_clause() -> None:
    """Compiled, the exception an ``except`` clause handles is kept in the thread's state, not
    the coroutine's (mypyc 2.4): after an ``await`` in the clause, the caller may have reset it,
    and a bare ``raise`` there raises nothing (the proxy's queue wait crashed the process so).
    Await after the clause, and raise the exception kept in a variable."""
    found = []
    for name in COMPILED_MODULES:
        path = REPO_ROOT / Path(*name.split(".")).with_suffix(".py")
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(function, ast.AsyncFunctionDef):
                continue
            found += [
                f"{name}:{node.lineno} ({function.name})"
                for node in ast.walk(function)
                if isinstance(node, ast.ExceptHandler) and _reads_the_exception_after_an_await(node)
            ]
    assert found == []


def test_no_compiled_module_leaves_a_final_tuple_untyped() -> None:
    """Compiled, a module-level ``NAME: Final = (0.5, 1.0, ...)`` tuple of floats without its
    full type is never set (mypyc 2.4): the first read raises ``NameError``.
    ``Final[tuple[float, ...]]`` is set."""
    found = []
    for name in COMPILED_MODULES:
        path = REPO_ROOT / Path(*name.split(".")).with_suffix(".py")
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.value, ast.Tuple)
                and ast.unparse(node.annotation) == "Final"
                and any(
                    isinstance(item, ast.Constant) and isinstance(item.value, float)
                    for item in node.value.elts
                )
            ):
                found.append(f"{name}.{ast.unparse(node.target)}")
    assert found == []


def test_no_compiled_module_leaves_a_cause_to_raise_from() -> None:
    """Compiled, ``raise error from cause`` leaves ``__cause__`` None (mypyc 2.4), and the
    upstream failure log reads it: a compiled module chains with ``caused_by``."""
    found = []
    for name in COMPILED_MODULES:
        path = REPO_ROOT / Path(*name.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Raise)
                and isinstance(node.cause, ast.Name)
                and not (
                    isinstance(node.exc, ast.Call)
                    and isinstance(node.exc.func, ast.Name)
                    and node.exc.func.id == "caused_by"
                )
            ):
                found.append(f"{name}:{node.lineno}")
    assert found == []


# Every algorithm, alone and stacked in the in-process store, over one seeded random trace of
# instants and costs: the digest of every decision and state. Run in this process (the build
# under test) and in a pure-Python copy of the sources, they must be equal.
TRACE = """
import hashlib, random
from gateway.algorithms.concurrency import Concurrency
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import token_bucket
from gateway.build import build_name
from gateway.clock import FakeClock
from gateway.limits.compiled import Check, CompiledLimit, LimitCounters
from gateway.limits.keys import KeyBuilder
from gateway.policy.models import LeakyBucketLimit
from gateway.stores.memory import MemoryStore

algorithms = [
    LeakyBucket(5, 1, 4, 2), LeakyBucket(30, 60, 3, None), LeakyBucket(2, 1, 0, 0),
    FixedWindow(7, 1.5), SlidingWindow(9, 2), SlidingLog(4, 0.7),
    token_bucket(3, 1, 4), token_bucket(5, 1, 2, mode="queue", max_delay_s=1.0),
    token_bucket(4, 1, mode="queue", warmup_s=2.0), Concurrency(3, 1.0),
]
random.seed(24)
digest = hashlib.sha256()
now_us = 1_763_000_000_000_000
states = [None] * len(algorithms)
for _ in range(3000):
    now_us += random.choice((0, 1, 999, 1000, 37_000, 250_000, 1_300_000))
    index = random.randrange(len(algorithms))
    cost = random.choice((1, 1, 1, 2, 5))
    decision, state = algorithms[index].decide(states[index], now_us, cost)
    if decision.allowed:
        states[index] = state
    digest.update(repr((index, decision, state)).encode())

clock = FakeClock(now_us)
store = MemoryStore(clock)
spec = LeakyBucketLimit(algorithm="leaky_bucket", rate="1r/s")
limits = [
    CompiledLimit(f"l{i}", spec, a, KeyBuilder(("client_ip",)), None, None, 1.0, LimitCounters())
    for i, a in enumerate(algorithms)
]
store.configure(limits, ())
for _ in range(3000):
    clock.advance(us=random.choice((0, 1000, 40_000, 300_000)))
    chosen = random.sample(limits, random.randint(1, 3))
    key = random.choice("abc")
    verdict = store.decide_now(
        [Check(limit, key, random.choice((0.5, 2.0, float("inf")))) for limit in chosen]
    )
    digest.update(repr(verdict).encode())
print(build_name(), digest.hexdigest())
"""


def test_the_pure_and_the_compiled_build_decide_alike(tmp_path: Path) -> None:
    if not compiled_modules():
        pytest.skip("no compiled build to compare (the pure build compares with itself)")
    shutil.copytree(
        REPO_ROOT / "gateway", tmp_path / "gateway", ignore=shutil.ignore_patterns("*.so")
    )
    result = subprocess.run(
        [sys.executable, "-c", TRACE],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pure_build, pure_digest = result.stdout.strip().rsplit(" ", 1)
    assert pure_build == "pure Python"
    here = subprocess.run(
        [sys.executable, "-c", TRACE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    build, digest = here.stdout.strip().rsplit(" ", 1)
    assert build == build_name()
    assert digest == pure_digest
    assert len(digest) == len(hashlib.sha256().hexdigest())
