#!/usr/bin/env bash
# The operator's short check, in seconds (the whole CI is `bash scripts/test.sh`): `gateway
# check` on every example policy, then a smoke run of policies/default.yaml on free loopback
# ports: ready, a request proxied to the demo backend, the sixth login attempt in a minute
# refused with 429, and a clean stop on SIGTERM. It runs the gateway installed in .venv (or
# the active virtual environment) by `bash scripts/demo.sh`; GATEWAY names another command.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python-env.sh
if [ -z "${GATEWAY:-}" ]; then
    if ! "$PY" -P -c 'import gateway' 2>/dev/null; then
        echo "smoke: no gateway installed in $VIRTUAL_ENV: run bash scripts/demo.sh first" >&2
        exit 1
    fi
    # `-P`: the installed package, not ./gateway (this source tree).
    GATEWAY="$PY -P -m gateway"
fi
# The example policies (check runs a policy's test cases, FILE.tests.yaml, with it).
echo "smoke: $GATEWAY check policies/*.yaml"
$GATEWAY check policies/*.yaml
exec "$PY" - "$GATEWAY" <<'SMOKE'
import re
import shlex
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

command = shlex.split(sys.argv[1])
run = [*command, "run", "--config", "policies/default.yaml"]
run += ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
print("smoke:", " ".join(run), flush=True)
proc = subprocess.Popen(
    run, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
)
watchdog = threading.Timer(60, proc.kill)  # nothing here may hang
watchdog.start()
said: list[str] = []


def fail(reason: str) -> None:
    proc.kill()
    watchdog.cancel()
    print("".join(said) + f"smoke: FAILED: {reason}", file=sys.stderr)
    sys.exit(1)


def status(method: str, url: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


started = None
assert proc.stdout is not None
for line in proc.stdout:
    said.append(line)
    started = re.search(r"serving on 127\.0\.0\.1:(\d+).*\(admin 127\.0\.0\.1:(\d+)\)", line)
    if started:
        break
if started is None:
    fail("the gateway exited before serving")
threading.Thread(target=lambda: said.extend(proc.stdout or ()), daemon=True).start()
proxy, admin = (f"http://127.0.0.1:{port}" for port in started.groups())
print(f"smoke: serving on {proxy}, admin {admin}", flush=True)
checks = [
    ("GET /readyz", status("GET", admin + "/readyz"), 200),
    ("GET /api/hello", status("GET", proxy + "/api/hello"), 200),
]
logins = [status("POST", proxy + "/api/login") for _ in range(6)]
checks.append(("6 logins in a minute (limit login: 5)", logins, [200] * 5 + [429]))
for what, got, wanted in checks:
    print(f"smoke: {what}: {got}", flush=True)
    if got != wanted:
        fail(f"{what}: expected {wanted}")
proc.send_signal(signal.SIGTERM)
code = proc.wait()
watchdog.cancel()
if code != 0:
    fail(f"exit status {code} after SIGTERM")
print("smoke: stopped on SIGTERM, exit 0; ok", flush=True)
SMOKE
