#!/usr/bin/env bash
# Builds the documentation site into site/ with MkDocs, installing it first (into .venv unless
# a virtual environment is active; the version pyproject.toml's test extra names):
# `mkdocs build --strict`, so a broken link or anchor fails it. Extra arguments go to
# `mkdocs build`; `bash scripts/docs.sh serve` serves the site while you edit instead.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python-env.sh
mkdocs=$("$PY" -c 'import re, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
print(next(r for r in extras["test"] if re.match(r"mkdocs\b", r)))')
"$PY" -m pip install -q --disable-pip-version-check "$mkdocs"
if [ "${1:-}" = "serve" ]; then
    shift
    exec "$PY" -m mkdocs serve "$@"
fi
exec "$PY" -m mkdocs build --strict "$@"
