#!/usr/bin/env bash
# Installs the gateway (in .venv unless a virtual environment is active) and runs it on the
# embedded default: in-process limit state and the built-in demo backend, nothing else needed.
# This is the README's first command. Extra arguments go to `gateway run`.
#
# The compiled build (a C compiler present) takes about three minutes on two cores, the
# pure-Python one (GATEWAY_PURE_PYTHON=1) about 20 s: pip hides a build's output, so the
# build runs with `pip -v` and this shows its progress lines (setup.py's `gateway build:`)
# and pip's own summary; the whole output is kept in build/demo-install.log.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python-env.sh

# setup.py compiles when it finds a C compiler (CC, else Python's own), as asked here.
compiler_found() {
    "$PY" -c 'import os, shutil, sys, sysconfig
cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
sys.exit(shutil.which(cc.split()[0]) is None)'
}
build_options=()
if [ "${GATEWAY_PURE_PYTHON:-0}" != "0" ] || ! compiler_found; then
    echo "Installing the pure-Python gateway into $VIRTUAL_ENV (about 20 s; a first run also"
    echo "downloads its dependencies)"
    # Nothing to compile: built in this environment, without pip's isolated one (which would
    # install mypyc's type-checking needs first, for nothing).
    "$PY" -m pip install -q --disable-pip-version-check "setuptools>=68" wheel
    build_options=(--no-build-isolation)
else
    echo "Installing the gateway into $VIRTUAL_ENV, its request path compiled to C with mypyc:"
    echo "about 3 minutes on two cores (GATEWAY_PURE_PYTHON=1 bash scripts/demo.sh: the"
    echo "pure-Python build, deciding alike, in about 20 s)"
fi
mkdir -p build
log=build/demo-install.log
started=$SECONDS
set +e
# The compiled build when a C compiler is here (GATEWAY_PURE_PYTHON=1: the pure one).
"$PY" -m pip install -v --disable-pip-version-check "${build_options[@]}" '.[speed]' 2>&1 | tee "$log" \
    | sed -un -e 's/^ *\(gateway build: .*\)$/  \1/p' -e '/^Successfully installed/p' \
        -e 's/^ *\(\(Installing build dependencies\|Getting requirements\|Preparing metadata\|Building wheel\)[^:]*: started\)$/\1/p' \
        -e '/^ERROR/p'
status=${PIPESTATUS[0]}
set -e
if [ "$status" != 0 ]; then
    tail -n 40 "$log" >&2
    echo "the install failed (exit $status; the whole output: $log)" >&2
    exit "$status"
fi
echo "installed in $((SECONDS - started)) s: $("$PY" -P -m gateway --version)"
# `-P`: the installed package, not ./gateway (this source tree, which `python -m` would put
# first).
exec "$PY" -P -m gateway run --config policies/default.yaml "$@"
