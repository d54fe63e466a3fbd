"""The gateway's build: its request path compiled to C with mypyc, as mypy and black ship theirs.

The modules compiled are listed once, in ``gateway/build.py``. They are compiled when a C
compiler is found; with none, or with ``GATEWAY_PURE_PYTHON=1``, the same package installs as
pure Python (``gateway --version`` says which build runs). Everything else is in pyproject.toml.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import setup

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


def ext_modules() -> list[Any]:
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        print(f"{PURE_PYTHON_ENV} is set: building the pure-Python gateway", file=sys.stderr)
        return []
    if not compiler_found():
        print("no C compiler found: building the pure-Python gateway", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    os.chdir(ROOT)  # mypyc takes paths relative to the project and reads its mypy settings
    paths = [os.path.join(*module.split(".")) + ".py" for module in listed_modules()]
    # One C file per module (multi_file): the same code as one 50 MB C file, compiled with half
    # the CPU (gcc's optimiser is slower than linear in a file's size; bench/README.md).
    return mypycify(  # type: ignore[no-any-return]
        paths, opt_level="3", group_name="gateway", multi_file=True
    )


setup(
    ext_modules=ext_modules(),
    # The package's small extension modules compile beside the shared library's C files.
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
