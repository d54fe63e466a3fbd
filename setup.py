"""The gateway's build: its request path compiled to C with mypyc, as mypy and black ship theirs.

The modules compiled are listed once, in ``gateway/build.py``. They are compiled when a C
compiler is found; with none, or with ``GATEWAY_PURE_PYTHON=1``, the same package installs as
pure Python (``gateway --version`` says which build runs). Everything else is in pyproject.toml.

The compiled build takes minutes, so it says how far it is on stderr, each line starting
``gateway build:`` (pip shows them with ``-v``; scripts/demo.sh shows only them): mypyc's
type-check and C generation, then each C file as the compiler starts on it, ``[i/n]``.
"""

from __future__ import annotations

import ast
import itertools
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
PURE_PYTHON_ENV = "GATEWAY_PURE_PYTHON"


def listed_modules() -> tuple[str, ...]:
    """``COMPILED_MODULES`` of gateway/build.py, read without importing the package."""
    tree = ast.parse((ROOT / "gateway" / "build.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "COMPILED_MODULES"
            and node.value is not None
        ):
            return tuple(ast.literal_eval(node.value))
    raise SystemExit("gateway/build.py lists no COMPILED_MODULES")


def compiler_found() -> bool:
    command = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(command.split()[0]) is not None


def say(message: str) -> None:
    """A progress line of the build, on stderr (pip passes it through with ``-v``)."""
    print(f"gateway build: {message}", file=sys.stderr, flush=True)


def metadata_only() -> bool:
    """pip asks setup.py for its requirements (``egg_info``) and metadata (``dist_info``)
    before it builds: nothing is compiled then, or mypyc's minute would run three times."""
    commands = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    return not commands or commands[0] in ("egg_info", "dist_info")


def ext_modules() -> list[Any]:
    if metadata_only():
        return []
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        say(f"{PURE_PYTHON_ENV} is set: the pure-Python gateway, nothing to compile")
        return []
    if not compiler_found():
        say("no C compiler found: the pure-Python gateway, nothing to compile")
        return []
    from mypyc.build import mypycify

    os.chdir(ROOT)  # mypyc takes paths relative to the project and reads its mypy settings
    paths = [os.path.join(*module.split(".")) + ".py" for module in listed_modules()]
    say(f"mypyc: type-checking {len(paths)} modules and writing their C")
    started = time.monotonic()
    # One C file per module (multi_file): the same code as one 50 MB C file, compiled with half
    # the CPU (gcc's optimiser is slower than linear in a file's size; bench/README.md).
    extensions: list[Any] = mypycify(paths, opt_level="3", group_name="gateway", multi_file=True)
    files = sum(len(extension.sources) for extension in extensions)
    say(f"mypyc: {files} C files written in {time.monotonic() - started:.0f} s")
    return extensions


class BuildExtWithProgress(build_ext):
    """``build_ext`` saying each C file as the compiler starts on it: the compile is most of
    the build's minutes, and pip shows nothing of it otherwise."""

    def build_extensions(self) -> None:
        total = sum(len(extension.sources) for extension in self.extensions)
        count = itertools.count(1)
        started = time.monotonic()
        compile_one = self.compiler._compile  # type: ignore[attr-defined]

        def compile_saying(obj: str, src: str, *args: Any) -> Any:
            say(f"[{next(count)}/{total}] compiling {os.path.relpath(src)}")
            return compile_one(obj, src, *args)

        if total:
            say(f"compiling {total} C files with {self.parallel or 1} jobs")
            self.compiler._compile = compile_saying  # type: ignore[attr-defined]
        super().build_extensions()
        if total:
            say(f"compiled in {time.monotonic() - started:.0f} s")


setup(
    ext_modules=ext_modules(),
    cmdclass={"build_ext": BuildExtWithProgress},
    # The package's small extension modules compile beside the shared library's C files.
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
