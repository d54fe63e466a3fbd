"""Command-line behaviour that does not need a running gateway."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gateway import __version__
from gateway.build import build_name
from gateway.cli.main import build_parser, main

ROOT = Path(__file__).parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
LOOPBACK = ("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0")


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_run_without_a_policy_says_what_to_give() -> None:
    result = _gateway("run")
    assert result.returncode == 1
    assert "use --config FILE (or GATEWAY_CONFIG), or --upstream URL" in result.stderr


def test_run_refuses_an_invalid_policy_with_its_line() -> None:
    bad = ROOT / "tests" / "fixtures" / "invalid" / "bad_listen.yaml"
    result = _gateway("run", "--config", str(bad))
    assert result.returncode == 1
    assert f"{bad}:2: server.listen: invalid listen address 'localhost'" in result.stderr


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "invalid").iterdir()))
def test_check_and_run_refuse_every_invalid_fixture_alike(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What check refuses, run refuses with the same lines, and the other way round."""
    path = str(FIXTURES / "invalid" / name)
    assert main(["check", path]) == 1
    refused = capsys.readouterr().err.strip()
    assert refused.startswith(path)
    with pytest.raises(SystemExit) as info:
        main(["run", "--config", path, *LOOPBACK])
    assert info.value.code == refused


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "valid").iterdir()))
def test_check_and_run_accept_every_valid_fixture_alike(name: str, tmp_path: Path) -> None:
    path = str(FIXTURES / "valid" / name)
    assert _gateway("check", path).returncode == 0
    log = tmp_path / "stderr"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", path, *LOOPBACK],
            stderr=stderr,
            stdout=subprocess.DEVNULL,
            cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 30
        while "serving on" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()


def test_a_limit_too_large_for_redis_is_one_line_from_run_not_a_traceback() -> None:
    path = FIXTURES / "invalid" / "redis_limit_too_large.yaml"
    result = _gateway("run", "--config", str(path), *LOOPBACK)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"{path}:10: limits.huge: 2 * limit + 1 (9.0072e+15)")


def _one_line_no_traceback(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr.strip()


def test_log_options_are_accepted_after_the_subcommand_too() -> None:
    parser = build_parser()
    args = parser.parse_args(["run", "--log-level", "debug", "--log-format", "json", "-c", "x"])
    assert (args.log_level, args.log_format) == ("DEBUG", "json")
    args = parser.parse_args(["--log-level", "warning", "run", "-c", "x"])
    assert (args.log_level, args.log_format) == ("WARNING", "text")
    result = _gateway("check", "--log-level", "DEBUG", str(FIXTURES / "valid" / "default.yaml"))
    assert result.returncode == 0, result.stderr


def test_an_invalid_log_level_is_one_line() -> None:
    message = _one_line_no_traceback(_gateway("run", "--log-level", "LOUD"))
    assert message == (
        "gateway run: argument --log-level: invalid log level 'LOUD': expected one of DEBUG, "
        "INFO, WARNING, ERROR, CRITICAL (see gateway run --help)"
    )
    env = {**os.environ, "GATEWAY_LOG_LEVEL": "LOUD"}
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "schema"], capture_output=True, text=True, env=env
    )
    assert _one_line_no_traceback(result).startswith("gateway: GATEWAY_LOG_LEVEL: invalid log")


def test_a_bad_listen_address_is_one_line() -> None:
    result = _gateway("run", "--config", "policies/default.yaml", "--listen", "nowhere")
    assert _one_line_no_traceback(result) == (
        "gateway: --listen: invalid listen address 'nowhere': expected HOST:PORT, e.g. 0.0.0.0:8080"
    )
    result = _gateway("run", "--config", "policies/default.yaml", "--workers", "0")
    assert "expected a positive number, got '0'" in _one_line_no_traceback(result)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_line(workers: str) -> None:
    """With --workers 2 the supervisor stops, rather than restarting workers that cannot bind."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _gateway(
            "run",
            "--upstream",
            "http://127.0.0.1:9",
            "--listen",
            f"127.0.0.1:{port}",
            "--admin-listen",
            "127.0.0.1:0",
            "--workers",
            workers,
        )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    expected = f"gateway: cannot listen on 127.0.0.1:{port} (proxy): address already in use"
    assert result.stderr.splitlines().count(expected) == 1  # once, however many workers


@pytest.mark.parametrize("command", [(), ("run",), ("check",), ("schema",), ("healthcheck",)])
def test_help_is_plain_text_with_examples_and_the_environment(command: tuple[str, ...]) -> None:
    result = _gateway(*command, "--help")
    assert result.returncode == 0
    assert "``" not in result.stdout and ":func:" not in result.stdout
    assert "examples:\n  gateway run --config" in result.stdout
    for name in (
        "GATEWAY_CONFIG",
        "GATEWAY_LOG_LEVEL",
        "GATEWAY_LOG_FORMAT",
        "GATEWAY_STORE_URL",
        "GATEWAY_ADMIN_TOKEN ",
        "GATEWAY_ADMIN_TOKEN_FILE",
    ):
        assert name in result.stdout
    if not command:
        assert (
            "{run,check,test,simulate,suggest,schema,healthcheck,replay,admin-token,keys}"
            in result.stdout
        )
        assert "    healthcheck " in result.stdout  # listed with what it does


def test_version() -> None:
    result = _gateway("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"gateway {__version__} ({build_name()})"


def _serve_a_few_requests(tmp_path: Path, *options: str) -> list[str]:
    """Run a real gateway with a JSON access log, send two requests, return its stderr lines."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n  access_log: true\n"
        "  access_log_format: json\nupstreams:\n  demo:\n    url: builtin:demo\n"
        "routes:\n  - name: all\n    upstream: demo\n"
    )
    log = tmp_path / "stderr"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", *options, "run", "--config", str(policy)],
            stderr=stderr,
            stdout=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        while "serving on 127.0.0.1:" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        port = re.search(r"serving on 127\.0\.0\.1:(\d+)", log.read_text())
        assert port is not None
        for path in ("/a?x=1", "/b"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}{path}", timeout=10):
                pass
        while log.read_text().count('"path"') < 2:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return log.read_text().splitlines()


def test_json_access_log_lines_are_json_objects_jq_reads(tmp_path: Path) -> None:
    lines = _serve_a_few_requests(tmp_path)
    access = [line for line in lines if '"path"' in line]
    jq = subprocess.run(
        ["jq", "-c", "[.path, .status, .limit]"],
        input="\n".join(access),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert jq.returncode == 0, jq.stderr
    assert jq.stdout.splitlines() == ['["/a?x=1",200,"none"]', '["/b",200,"none"]']
    assert all("time" in json.loads(line) for line in access)


def test_the_start_line_names_the_store_and_the_dashboard(tmp_path: Path) -> None:
    lines = _serve_a_few_requests(tmp_path)
    (start,) = [line for line in lines if "serving on" in line]
    found = re.search(
        r"serving on 127\.0\.0\.1:\d+ \(admin 127\.0\.0\.1:(\d+)\), policy \S+ sha256 \w{12}, "
        r"store memory; dashboard http://127\.0\.0\.1:(\d+)/dashboard/$",
        start,
    )
    assert found is not None, start
    assert found.group(1) == found.group(2)


def test_a_clean_stop_of_several_workers_leaves_nothing_in_shared_memory() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GATEWAY_METRICS_DIR",)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "run", "--upstream", "http://127.0.0.1:9", *LOOPBACK,
         "--workers", "2"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics = Path("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp") / (
        f"gateway-metrics-{proc.pid}"
    )
    try:
        deadline = time.monotonic() + 60
        while not (metrics.is_dir() and len(list(metrics.iterdir())) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert not metrics.exists()


def test_log_format_json_makes_every_line_a_json_object(tmp_path: Path) -> None:
    lines = _serve_a_few_requests(tmp_path, "--log-format", "json")
    records = [json.loads(line) for line in lines]  # every line, the gateway's own included
    serving = [r for r in records if "serving on" in r.get("message", "")]
    assert serving and serving[0]["logger"] == "gateway" and serving[0]["level"] == "INFO"
    assert [r["path"] for r in records if "path" in r] == ["/a?x=1", "/b"]


def test_admin_token_refuses_a_short_secret_in_one_line(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("short\n")
    result = _gateway("admin-token", str(tmp_path / "token"), "--from", str(secret))
    assert result.returncode == 1
    assert _one_line_no_traceback(result) == (
        f"gateway admin-token: {secret}: the admin token is shorter than 16 characters"
    )
    assert not (tmp_path / "token").exists()


@pytest.mark.reliability
def test_check_binds_the_listen_addresses_as_nginx_t_does(tmp_path: Path) -> None:
    """An address on no local interface: ``check`` refuses it with its line, as ``run``
    refuses it; an address in use is accepted (it may be the running gateway's own)."""
    policy = tmp_path / "policy.yaml"
    template = (
        "server:\n  listen: {listen}\n  admin_listen: 127.0.0.1:0\n"
        "upstreams:\n  backend:\n    url: http://127.0.0.1:9\n"
        "routes:\n  - name: all\n    upstream: backend\n"
    )
    policy.write_text(template.format(listen="192.0.2.1:8080"))  # TEST-NET-1: nobody's
    checked = _gateway("check", str(policy))
    assert checked.returncode == 1
    assert checked.stderr == (
        f"{policy}:2: server.listen: cannot listen on 192.0.2.1:8080: cannot assign requested "
        "address (no local interface has this address)\n"
    )
    run = _gateway("run", "--config", str(policy))
    assert _one_line_no_traceback(run) == (
        "gateway: cannot listen on 192.0.2.1:8080 (proxy): cannot assign requested address"
    )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        policy.write_text(template.format(listen=f"127.0.0.1:{busy.getsockname()[1]}"))
        assert _gateway("check", str(policy)).returncode == 0


def test_check_refuses_the_admin_token_run_refuses(tmp_path: Path) -> None:
    """A token file that cannot be read, or a token too short: ``run`` will not start, so
    ``check`` does not say ok (the token never printed). A relative name is beside the policy
    file, as its other files are, wherever the gateway is started."""
    policy = tmp_path / "policy.yaml"
    missing = tmp_path / "admin-token"
    policy.write_text(
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        "  admin_token_file: admin-token\n"
        "upstreams:\n  backend:\n    url: http://127.0.0.1:9\n"
        "routes:\n  - name: all\n    upstream: backend\n"
    )
    checked = _gateway("check", str(policy))
    assert (checked.returncode, checked.stderr) == (
        1,
        f"{policy}:4: server.admin_token_file: admin token file {missing}: cannot read it: "
        "No such file or directory\n",
    )
    run = _gateway("run", "--config", str(policy))
    assert _one_line_no_traceback(run) == (
        f"gateway: admin token file {missing}: cannot read it: No such file or directory"
    )
    missing.write_text("short-secret\n")
    checked = _gateway("check", str(policy))
    assert checked.returncode == 1 and "shorter than 16 characters" in checked.stderr
    assert "short-secret" not in checked.stderr
    missing.write_text("a-token-long-enough-to-use\n")
    assert _gateway("check", str(policy)).returncode == 0


@pytest.mark.reliability
def test_run_refuses_listen_and_admin_listen_on_one_port_from_the_command_line() -> None:
    result = _gateway(
        "run", "--upstream", "http://127.0.0.1:9",
        "--listen", "0.0.0.0:18999", "--admin-listen", "127.0.0.1:18999", "--workers", "2",
    )  # fmt: skip
    assert _one_line_no_traceback(result) == (
        "gateway: the proxy (0.0.0.0:18999) and the admin listener (127.0.0.1:18999) take the "
        "same port: give the admin listener a port of its own"
    )


UNLISTED_REJECT = (
    "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
    "upstreams:\n  demo:\n    url: builtin:demo\n"
    "routes:\n  - name: all\n    upstream: demo\n"
    "limits:\n  per_key:\n    algorithm: fixed_window\n    limit: 10\n    window: 1m\n"
    "    key: ['header:X-Api-Key']\n{missing}    overrides: {{key-1: {{limit: 100}}}}\n"
    "    unlisted: reject\n"
)
UNLISTED_REJECT_WARNING = (
    "policy.yaml:17: warning: limits.per_key.unlisted: reject, but a request without "
    "header:X-Api-Key skips this limit (on_missing_key: skip, the default) rather than being "
    "rejected: set on_missing_key: client_ip to reject it as unlisted too"
)


def test_check_warns_that_a_missing_key_skips_a_limit_that_rejects_unlisted_keys(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(UNLISTED_REJECT.format(missing=""))
    checked = _gateway("check", str(policy))
    assert checked.returncode == 0, checked.stderr  # a warning, not a refusal: run accepts it
    assert checked.stderr.splitlines() == [f"{tmp_path}/{UNLISTED_REJECT_WARNING}"]
    assert checked.stdout.startswith(f"{policy}: ok")

    policy.write_text(UNLISTED_REJECT.format(missing="    on_missing_key: client_ip\n"))
    checked = _gateway("check", str(policy))
    assert (checked.returncode, checked.stderr) == (0, "")


def test_run_logs_the_warnings_check_prints(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(UNLISTED_REJECT.format(missing=""))
    log = tmp_path / "stderr"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(policy)],
            stderr=stderr,
            stdout=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        while UNLISTED_REJECT_WARNING not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    (line,) = [line for line in log.read_text().splitlines() if "warning:" in line]
    assert "WARNING" in line
