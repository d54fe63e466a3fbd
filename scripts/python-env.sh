# Sourced by scripts/test.sh and scripts/demo.sh: sets PY to a Python that pip may install into.
# Debian's own python3 refuses `pip install` outside a virtual environment (PEP 668), so unless
# one is active we make `.venv` here (installing Debian's python3-venv first when the interpreter
# lacks ensurepip). PYTHON picks the interpreter (default python3).
SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
PY=${PYTHON:-python3}
if [ -z "${VIRTUAL_ENV:-}" ]; then
    if ! "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; then
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv
    fi
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    VIRTUAL_ENV="$PWD/.venv"
    PATH="$VIRTUAL_ENV/bin:$PATH"
    export VIRTUAL_ENV PATH
    PY="$VIRTUAL_ENV/bin/python"
fi
