#!/usr/bin/env bash
# Installs everything the tests need (system packages included) and runs them.
# This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/python-env.sh
need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v openssl >/dev/null 2>&1 || need+=(openssl)      # rediss:// tests make a CA
command -v jq >/dev/null 2>&1 || need+=(jq)                # JSON access log read by jq
[ -x /usr/bin/chromium ] || need+=(chromium)            # dashboard tests (headless)
[ -x /usr/bin/prometheus ] || need+=(prometheus)        # PromQL of the Grafana dashboard
command -v gcc >/dev/null 2>&1 || need+=(gcc)              # the compiled build (mypyc)
"$PY" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
    || need+=(python3-dev)                              # its C headers, for the same
if [ ${#need[@]} -gt 0 ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi

# Both builds are tested, in place (tests import gateway/ from this tree, and spawn
# `python -m gateway` here): first the pure-Python build on the tests of what decides (the
# algorithms, engine, stores, nginx and Redis differentials), then the compiled build, the one
# `pip install .` gives, on the whole suite. tests/test_build.py fails a run whose modules are
# not the build it expects. The build tools are installed here so both builds use them
# without an isolated build environment (and its downloads) each time.
$PY -m pip install -q --disable-pip-version-check "setuptools>=68" wheel "mypy==2.4.1"
find gateway -name '*.so' -delete
rm -f gateway__mypyc.*.so
started=$SECONDS
GATEWAY_PURE_PYTHON=1 $PY -m pip install -q --disable-pip-version-check --no-build-isolation \
    -e ".[test,speed]"
echo "pure-Python build installed in $((SECONDS - started)) s"

$PY -m ruff check gateway tests bench
$PY -m mypy gateway
# The dashboard test saves its screenshot here (a test artifact, not committed).
export GATEWAY_TEST_ARTIFACTS="${GATEWAY_TEST_ARTIFACTS:-$PWD/test-artifacts}"
mkdir -p "$GATEWAY_TEST_ARTIFACTS"

pytest_run() {
    set +e
    $PY -m pytest -p no:cacheprovider "$@"
    local rc=$?
    set -e
    if [ "$rc" = "5" ]; then
        echo "pytest collected no tests: failing" >&2
        return 1
    fi
    return "$rc"
}

PURE_TESTS=(
    tests/test_build.py tests/test_leaky_bucket.py tests/test_fixed_window.py
    tests/test_sliding_window.py tests/test_sliding_log.py tests/test_token_bucket.py
    tests/test_combine.py tests/test_engine.py tests/test_keyed_state.py tests/test_memory_store.py
    tests/test_tiers.py tests/test_nginx_differential.py tests/test_redis_store.py
    tests/test_redis_codecs.py tests/test_shared_store.py tests/test_response_charge.py
    tests/test_calendar_period.py tests/test_calendar_window.py
)
# The compiled build's C takes minutes to compile: it compiles (into build/compiled, not the
# tree the running tests import) while the pure-Python build's tests run, and is then copied
# beside the sources, as `pip install -e .` or `setup.py build_ext --inplace` puts it.
compile_log=build/compile.log
mkdir -p build
rm -rf build/compiled
started=$SECONDS
$PY setup.py -q build_ext --build-lib build/compiled >"$compile_log" 2>&1 &
compile_pid=$!
pure_rc=0
if [ $# -eq 0 ]; then
    GATEWAY_EXPECT_BUILD="pure Python" pytest_run "${PURE_TESTS[@]}" || pure_rc=$?
fi
if ! wait "$compile_pid"; then
    tail -n 40 "$compile_log" >&2
    echo "the compiled build failed to compile (whole log: $compile_log)" >&2
    exit 1
fi
$PY - <<'COPY'
import shutil
from pathlib import Path

built = Path("build/compiled")
for extension in built.rglob("*.so"):
    shutil.copy2(extension, extension.relative_to(built))
COPY
echo "compiled build installed in $((SECONDS - started)) s (compiled while the pure build's tests ran)"
rc=0
if [ $# -eq 0 ]; then
    # Most tests wait on sockets and processes more than they compute: two run at a time (a
    # test file per process, pytest-xdist). Those that measure under load (admissions per
    # window, latency, spread: marked `serial`) run afterwards, alone.
    GATEWAY_EXPECT_BUILD=compiled pytest_run -n 2 --dist loadfile -m "not serial and not soak" \
        || rc=$?
    GATEWAY_EXPECT_BUILD=compiled pytest_run -m "serial and not soak" || rc=$?
else
    GATEWAY_EXPECT_BUILD=compiled pytest_run "$@" || rc=$?
fi
if [ "$pure_rc" != 0 ]; then
    echo "the pure-Python build's tests failed" >&2
    exit "$pure_rc"
fi
exit "$rc"
