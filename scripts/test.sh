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
if [ ${#need[@]} -gt 0 ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi

$PY -m pip install -q --disable-pip-version-check -e ".[test,speed]"

$PY -m ruff check gateway tests bench
$PY -m mypy gateway
# The dashboard test saves its screenshot here (a test artifact, not committed).
export GATEWAY_TEST_ARTIFACTS="${GATEWAY_TEST_ARTIFACTS:-$PWD/test-artifacts}"
mkdir -p "$GATEWAY_TEST_ARTIFACTS"
set +e
$PY -m pytest -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" = "5" ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
