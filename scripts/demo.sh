#!/usr/bin/env bash
# Installs the gateway (in .venv unless a virtual environment is active) and runs it on the
# embedded default: in-process limit state and the built-in demo backend, nothing else needed.
# This is the README's first command. Extra arguments go to `gateway run`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python-env.sh
# The compiled build when a C compiler is here (GATEWAY_PURE_PYTHON=1: the pure one). `-P`:
# the installed package, not ./gateway (this source tree, which `python -m` would put first).
"$PY" -m pip install -q --disable-pip-version-check '.[speed]'
exec "$PY" -P -m gateway run --config policies/default.yaml "$@"
