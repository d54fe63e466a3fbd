"""What the container files run, run for real (no Docker engine here): the compose demo backend,
the image's environment-driven entrypoint, ``gateway healthcheck``, the SIGTERM drain delay, and
the Kubernetes manifests validated offline."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import kubernetes_validate
import pytest
import yaml

from gateway.admin.auth import AdminAuth
from gateway.cli.supervisor import EXIT_STARTUP
from gateway.engine.preflight import load_and_build, parse_and_build
from gateway.policy.models import Policy, ServerSettings, split_host_port
from gateway.stores import store_url
from tests.support import netns
from tests.support.dockerfile import dockerfile_env, final_stage
from tests.support.gateways import GatewayFactory
from tests.support.network import free_port
from tests.support.processes import LoggedProcess as Process
from tests.support.waiting import wait_for_status, wait_until

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = aiohttp.ClientTimeout(total=5)


Spawn = Callable[..., Awaitable[Process]]


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Spawn]:
    """Start a command (stdout and stderr to a file); killed at the end if still running."""
    started: list[Process] = []

    async def start(*cmd: str, env: dict[str, str] | None = None) -> Process:
        log_path = tmp_path / f"process-{len(started)}.log"
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                cwd=ROOT,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        started.append(Process(proc, log_path))
        return started[-1]

    yield start
    for running in started:
        if running.proc.returncode is None:
            running.proc.kill()
            await running.proc.wait()


def compose() -> dict[str, dict[str, dict[str, object]]]:
    data: dict[str, dict[str, dict[str, object]]] = yaml.safe_load(
        (ROOT / "deploy" / "compose" / "docker-compose.yml").read_text()
    )
    return data


def on_loopback(args: list[str], port: int) -> list[str]:
    """A container command with its 0.0.0.0 listen addresses moved to loopback (tests use
    loopback only)."""
    return [a.replace("0.0.0.0:8000", f"127.0.0.1:{port}") for a in args]


async def test_compose_backend_serves_json_about_the_request_and_no_files(spawn: Spawn) -> None:
    backend = compose()["services"]["backend"]
    entrypoint = [str(a) for a in backend["entrypoint"]]  # type: ignore[attr-defined]
    command = [str(a) for a in backend["command"]]  # type: ignore[attr-defined]
    assert entrypoint[0] == "python"
    port = free_port()
    process = await spawn(sys.executable, *on_loopback(entrypoint[1:] + command, port))
    base = f"http://127.0.0.1:{port}"
    await wait_for_status(process, base + "/")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for path in ("/", "/etc/passwd", "/proc/self/environ", "/../../etc/passwd"):
            async with session.get(base + path) as resp:
                assert resp.content_type == "application/json", path
                body = await resp.text()
            assert "root:" not in body
            assert "PATH=" not in body
            assert "Directory listing" not in body


def test_compose_admin_token_service_makes_one_token_and_keeps_it(tmp_path: Path) -> None:
    entrypoint = [str(a) for a in compose()["services"]["admin-token"]["entrypoint"]]
    assert entrypoint[:2] == ["gateway", "admin-token"]
    token_file = tmp_path / "admin-token"
    argv = [str(token_file) if a == entrypoint[2] else a for a in entrypoint[1:]]
    first = _run_gateway(*argv)
    assert first.returncode == 0, first.stderr
    token = token_file.read_text()
    assert len(token.strip()) >= 32 and token.strip() not in first.stdout
    again = _run_gateway(*argv)  # the next `docker compose up`: the same token
    assert again.returncode == 0 and token_file.read_text() == token


# -- the image's entrypoint, driven by its environment ---------------------------------------


def image_command(*cmd: str) -> list[str]:
    """The image's ENTRYPOINT (and CMD unless ``cmd`` replaces it), as this interpreter runs it."""
    stage = dict(final_stage())
    entrypoint = json.loads(stage["ENTRYPOINT"])
    assert entrypoint[0] == "gateway"
    args = list(cmd) if cmd else json.loads(stage.get("CMD", "[]"))
    return [sys.executable, "-m", "gateway", *entrypoint[1:], *args]


def image_env_as_is() -> dict[str, str]:
    """The image's ENV with its paths mapped to this checkout through its COPY lines."""
    env = dockerfile_env()
    copies = [rest.split() for k, rest in final_stage() if k == "COPY" and "--from" not in rest]
    for name, value in env.items():
        for *sources, dst in copies:
            if len(sources) == 1 and value.startswith(dst.rstrip("/") + "/"):
                env[name] = str(ROOT / sources[0]) + value[len(dst.rstrip("/")) :]
    return env


def image_env(port: int, admin_port: int) -> dict[str, str]:
    """The image's ENV with its paths mapped to this checkout and its 0.0.0.0 listeners moved
    to loopback ports (outside a network namespace of their own, tests use loopback only)."""
    env = image_env_as_is()
    assert env["GATEWAY_LISTEN"].startswith("0.0.0.0:")
    assert env["GATEWAY_ADMIN_LISTEN"].startswith("0.0.0.0:")
    env["GATEWAY_LISTEN"] = f"127.0.0.1:{port}"
    env["GATEWAY_ADMIN_LISTEN"] = f"127.0.0.1:{admin_port}"
    assert Path(env["GATEWAY_CONFIG"]).is_file(), env["GATEWAY_CONFIG"]
    return env


async def test_image_runs_its_default_policy_on_the_environment_listeners(spawn: Spawn) -> None:
    port, admin_port = free_port(), free_port()
    env = image_env(port, admin_port)
    process = await spawn(*image_command(), env=env)
    await wait_for_status(process, f"http://127.0.0.1:{admin_port}/readyz")
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(f"http://127.0.0.1:{port}/api/hello") as resp,
    ):
        assert resp.status == 200
        assert (await resp.json())["service"] == "gateway demo upstream"


async def test_the_image_listeners_as_they_are_get_an_admin_token_made_for_them(
    spawn: Spawn, tmp_path: Path
) -> None:
    """`docker run IMAGE`: the admin listener on 0.0.0.0 with no token given would be refused,
    so the image has ``gateway run`` make one where GATEWAY_ADMIN_TOKEN_AUTO_FILE says (and
    keep it over a restart), as Kubernetes mounts a service account's token; run in a network
    namespace of its own, where 0.0.0.0 is its loopback device only."""
    netns.need_netns()
    env = image_env_as_is()
    assert env["GATEWAY_ADMIN_LISTEN"] == "0.0.0.0:9090"
    image_token = PurePosixPath(env["GATEWAY_ADMIN_TOKEN_AUTO_FILE"])
    made = re.search(r"install -d -o gateway -g gateway -m 0700 (\S+)", docker_text())
    assert made is not None and made.group(1) == str(image_token.parent)  # the user writes it
    (tmp_path / "run-gateway").mkdir()
    token_file = tmp_path / "run-gateway" / image_token.name
    env.update(
        GATEWAY_ADMIN_TOKEN_AUTO_FILE=str(token_file),
        GATEWAY_ADMIN_TOKEN="",
        GATEWAY_ADMIN_TOKEN_FILE="",
    )
    admin = f"http://{netns.ADDRESS}:9090"
    tokens = []
    for _ in range(2):  # the container restarted: the same token
        process = await spawn(*netns.in_new_netns(*image_command()), env=env)
        await wait_until(functools.partial(_started, process), "the start line", within_s=30)
        assert process.proc.returncode is None, process.log()
        token = token_file.read_text().strip()
        assert len(token) >= 32 and token_file.stat().st_mode & 0o777 == 0o600
        assert token not in process.log()
        assert f"read it there (docker exec CONTAINER cat {token_file})" in process.log()
        pid, bearer = process.proc.pid, {"Authorization": f"Bearer {token}"}
        assert await netns.request(pid, "POST", admin + "/reload") == 401
        assert await netns.request(pid, "GET", admin + "/policy") == 401
        assert await netns.request(pid, "GET", admin + "/policy", bearer) == 200
        assert await netns.request(pid, "GET", admin + "/readyz") == 200  # the HEALTHCHECK's
        # The HEALTHCHECK, another process, finds the token run made when a path needs it.
        probe = await asyncio.create_subprocess_exec(
            "nsenter", "-t", str(pid), "-n",
            *image_command_of("gateway", "healthcheck", "--path", "/policy"),
            cwd=ROOT, env={**os.environ, **env}, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        said = (await asyncio.wait_for(probe.communicate(), 30))[0].decode()
        assert (probe.returncode, said) == (0, "http://127.0.0.1:9090/policy: 200 OK\n")
        tokens.append(token)
        process.proc.terminate()
        assert await asyncio.wait_for(process.proc.wait(), 20) == 0
    assert tokens[0] == tokens[1]


def image_command_of(*argv: str) -> list[str]:
    """A command of the image (``gateway ...``), as this interpreter runs it."""
    assert argv[0] == "gateway"
    return [sys.executable, "-m", "gateway", *argv[1:]]


def _started(process: Process) -> bool:
    return " serving on " in process.log() or process.proc.returncode is not None


def test_check_in_the_image_accepts_what_run_starts_there() -> None:
    """With the image's environment `gateway check` accepts its default policy (`run` makes
    the token); without GATEWAY_ADMIN_TOKEN_AUTO_FILE it refuses the open admin listener."""
    env = {**image_env_as_is(), "GATEWAY_ADMIN_TOKEN": "", "GATEWAY_ADMIN_TOKEN_FILE": ""}
    check = _run_gateway("check", env["GATEWAY_CONFIG"], env=env)
    assert check.returncode == 0, check.stderr
    check = _run_gateway(
        "check", env["GATEWAY_CONFIG"], env={**env, "GATEWAY_ADMIN_TOKEN_AUTO_FILE": ""}
    )
    assert check.returncode == 1
    assert "0.0.0.0:9090 (GATEWAY_ADMIN_LISTEN) is off loopback" in check.stderr


def docker_text() -> str:
    return (ROOT / "Dockerfile").read_text()


async def test_a_mounted_policy_copied_from_default_keeps_the_image_listeners(
    spawn: Spawn, tmp_path: Path
) -> None:
    """`docker run IMAGE --config /etc/gateway/policies/mine.yaml` with a copy of default.yaml
    (which says 127.0.0.1:8080): the environment's listeners win over the file's."""
    mounted = tmp_path / "etc-gateway-policies"
    mounted.mkdir()
    (mounted / "mine.yaml").write_text((ROOT / "policies" / "default.yaml").read_text())
    port, admin_port = free_port(), free_port()
    process = await spawn(
        *image_command("--config", str(mounted / "mine.yaml")), env=image_env(port, admin_port)
    )
    await wait_for_status(process, f"http://127.0.0.1:{admin_port}/readyz")
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(f"http://127.0.0.1:{port}/api/hello") as resp,
    ):
        assert resp.status == 200
        # The policy in force is the mounted one, not the image's default.
        async with session.get(f"http://127.0.0.1:{admin_port}/policy") as policy:
            assert (await policy.json())["source"] == str(mounted / "mine.yaml")


async def test_loopback_listeners_in_a_container_are_a_loud_warning(
    spawn: Spawn, tmp_path: Path
) -> None:
    port, admin_port = free_port(), free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        (ROOT / "policies" / "default.yaml")
        .read_text()
        .replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        .replace("127.0.0.1:9090", f"127.0.0.1:{admin_port}")
    )
    env = {"GATEWAY_IN_CONTAINER": "1", "GATEWAY_LISTEN": "", "GATEWAY_ADMIN_LISTEN": ""}
    process = await spawn(*image_command("--config", str(policy)), env=env)
    await wait_for_status(process, f"http://127.0.0.1:{admin_port}/readyz")
    warnings = [line for line in process.log().splitlines() if "UNREACHABLE" in line]
    assert len(warnings) == 2, process.log()
    assert all(" WARNING " in line for line in warnings)
    assert f"proxy listener is on 127.0.0.1:{port}" in warnings[0]
    assert "GATEWAY_LISTEN" in warnings[0]
    assert f"admin listener is on 127.0.0.1:{admin_port}" in warnings[1]


async def test_a_bad_listen_variable_is_one_line_and_a_startup_exit_code(spawn: Spawn) -> None:
    process = await spawn(
        *image_command("--config", str(ROOT / "policies" / "default.yaml")),
        env={"GATEWAY_LISTEN": "nowhere"},
    )
    assert await asyncio.wait_for(process.proc.wait(), 20) == EXIT_STARTUP
    assert process.log().strip() == (
        "gateway: GATEWAY_LISTEN: invalid listen address 'nowhere': expected HOST:PORT, "
        "e.g. 0.0.0.0:8080"
    )


# -- gateway healthcheck ---------------------------------------------------------------------


async def run_healthcheck(spawn: Spawn, *args: str, env: dict[str, str]) -> tuple[int, str]:
    process = await spawn(sys.executable, "-m", "gateway", "healthcheck", *args, env=env)
    code = await asyncio.wait_for(process.proc.wait(), 20)
    return code, process.log().strip()


async def test_healthcheck_probes_the_admin_address_the_gateway_uses(
    spawn: Spawn, tmp_path: Path
) -> None:
    port, admin_port = free_port(), free_port()
    env = image_env(port, admin_port)
    env["GATEWAY_ADMIN_LISTEN"] = f"0.0.0.0:{admin_port}"  # a wildcard is probed on loopback
    gateway = await spawn(*image_command(), env=image_env(port, admin_port))
    await wait_for_status(gateway, f"http://127.0.0.1:{admin_port}/readyz")
    code, out = await run_healthcheck(spawn, env=env)
    assert (code, out) == (0, f"http://127.0.0.1:{admin_port}/readyz: 200 OK")

    # From the policy file when the environment does not say.
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f"server:\n  admin_listen: 127.0.0.1:{admin_port}\n"
        "upstreams:\n  demo:\n    url: builtin:demo\nroutes:\n  - name: all\n    upstream: demo\n"
    )
    bare = {"GATEWAY_ADMIN_LISTEN": "", "GATEWAY_CONFIG": ""}
    assert (await run_healthcheck(spawn, "--config", str(policy), env=bare))[0] == 0
    env_config = {"GATEWAY_ADMIN_LISTEN": "", "GATEWAY_CONFIG": str(policy)}
    assert (await run_healthcheck(spawn, env=env_config))[0] == 0

    gateway.proc.terminate()
    assert await asyncio.wait_for(gateway.proc.wait(), 20) == 0
    code, out = await run_healthcheck(spawn, env=env)
    assert code == 1
    assert out == (f"gateway healthcheck: http://127.0.0.1:{admin_port}/readyz: Connection refused")


async def test_healthcheck_fails_on_a_gateway_that_is_not_ready(spawn: Spawn) -> None:
    """A real HTTP server answering /readyz with 503, as a draining gateway does."""
    from aiohttp import web

    async def not_ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "not ready"}, status=503)

    app = web.Application()
    app.router.add_get("/readyz", not_ready)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    admin_port = runner.addresses[0][1]
    try:
        code, out = await run_healthcheck(
            spawn, env={"GATEWAY_ADMIN_LISTEN": f"127.0.0.1:{admin_port}", "GATEWAY_CONFIG": ""}
        )
    finally:
        await runner.cleanup()
    assert code == 1
    assert out == (
        f"gateway healthcheck: http://127.0.0.1:{admin_port}/readyz: 503 Service Unavailable"
    )


async def test_healthcheck_sends_the_admin_token_when_readyz_needs_it(
    spawn: Spawn, tmp_path: Path
) -> None:
    token = "probe-token-0123456789abcdef"
    policy = tmp_path / "policy.yaml"
    port, admin_port = free_port(), free_port()
    policy.write_text(
        f"server:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin_port}\n"
        "  admin_public_paths: [/healthz]\n"
        "upstreams:\n  demo:\n    url: builtin:demo\nroutes:\n  - name: all\n    upstream: demo\n"
    )
    env = {"GATEWAY_ADMIN_TOKEN": token, "GATEWAY_LISTEN": "", "GATEWAY_ADMIN_LISTEN": ""}
    gateway = await spawn(sys.executable, "-m", "gateway", "run", "--config", str(policy), env=env)
    await wait_for_status(gateway, f"http://127.0.0.1:{admin_port}/readyz", status=401)
    assert (await run_healthcheck(spawn, "--config", str(policy), env=env))[0] == 0
    wrong = {**env, "GATEWAY_ADMIN_TOKEN": "not-the-token-0123456789"}
    code, out = await run_healthcheck(spawn, "--config", str(policy), env=wrong)
    assert code == 1
    assert out.endswith("/readyz: 401 Unauthorized")
    assert token not in out and "not-the-token" not in out
    assert (
        await run_healthcheck(
            spawn,
            "--config",
            str(policy),
            "--path",
            "/healthz",
            env={**env, "GATEWAY_ADMIN_TOKEN": ""},
        )
    )[0] == 0


# -- SIGTERM: readiness off for the drain delay, then the listeners close -------------------


def _drain_policy(port: int, admin_port: int, drain: str) -> str:
    return (
        f"server:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin_port}\n"
        f"  drain_delay: {drain}\n  shutdown_timeout: 5s\n"
        "upstreams:\n  demo:\n    url: builtin:demo\nroutes:\n  - name: all\n    upstream: demo\n"
    )


async def _start_draining_gateway(
    spawn: Spawn, tmp_path: Path, drain: str
) -> tuple[Process, str, str]:
    port, admin_port = free_port(), free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(_drain_policy(port, admin_port, drain))
    env = {"GATEWAY_LISTEN": "", "GATEWAY_ADMIN_LISTEN": ""}
    process = await spawn(sys.executable, "-m", "gateway", "run", "--config", str(policy), env=env)
    admin = f"http://127.0.0.1:{admin_port}"
    await wait_for_status(process, admin + "/readyz")
    return process, f"http://127.0.0.1:{port}", admin


async def _get(session: aiohttp.ClientSession, url: str) -> int | None:
    """The status, or None when the connection is refused."""
    try:
        async with session.get(url) as resp:
            await resp.read()
            return resp.status
    except aiohttp.ClientConnectionError:
        return None


async def test_sigterm_turns_readyz_503_for_the_drain_delay_before_closing(
    spawn: Spawn, tmp_path: Path
) -> None:
    process, proxy, admin = await _start_draining_gateway(spawn, tmp_path, "1500ms")
    loop = asyncio.get_running_loop()
    # One connection per request, as a load balancer's probes and new clients would come.
    connector = aiohttp.TCPConnector(force_close=True)
    seen: list[tuple[float, int | None, int | None]] = []
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        process.proc.terminate()
        signalled = loop.time()
        while loop.time() - signalled < 10.0:
            ready, served = await _get(session, admin + "/readyz"), await _get(session, proxy + "/")
            seen.append((loop.time() - signalled, ready, served))
            if ready is None and served is None:
                break
            await asyncio.sleep(0.05)
    assert await asyncio.wait_for(process.proc.wait(), 10) == 0
    draining = [t for t, ready, served in seen if ready == 503 and served == 200]
    closed = [t for t, ready, served in seen if ready is None and served is None]
    # Not ready while still serving, from soon after the signal; never ready again; refused
    # only once the drain delay has passed. (The signal and the first probe may race, so a
    # 200 before the first 503 is allowed.)
    assert draining and draining[0] < 1.4, seen
    first_503 = next(i for i, (_, ready, _) in enumerate(seen) if ready == 503)
    assert all(ready != 200 for _, ready, _ in seen[first_503:]), seen
    assert closed and closed[0] >= 1.5, seen
    assert "draining: /readyz answers 503 for 1.5s" in process.log()


async def test_a_second_sigterm_ends_the_drain_early(spawn: Spawn, tmp_path: Path) -> None:
    process, _, admin = await _start_draining_gateway(spawn, tmp_path, "60s")
    loop = asyncio.get_running_loop()
    process.proc.terminate()
    await wait_for_status(process, admin + "/readyz", status=503)
    started = loop.time()
    process.proc.terminate()
    assert await asyncio.wait_for(process.proc.wait(), 10) == 0
    assert loop.time() - started < 5


# -- Kubernetes manifests --------------------------------------------------------------------

MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))


def documents(kind: str | None = None, file: str | None = None) -> list[dict[str, Any]]:
    found = []
    for path in MANIFESTS:
        if file is not None and path.name != file:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None and (kind is None or doc["kind"] == kind):
                found.append(doc)
    return found


def manifest_policy(file: str, tmp_path: Path) -> Policy:
    """The policy a manifest's ConfigMap holds, loaded as the gateway loads it."""
    (configmap,) = documents("ConfigMap", file)
    ((name, text),) = configmap["data"].items()
    path = tmp_path / file.replace(".yaml", "") / name
    path.parent.mkdir()
    path.write_text(text)
    return load_and_build(path).policy


def gateway_deployment() -> dict[str, Any]:
    (deployment,) = [d for d in documents("Deployment") if d["metadata"]["name"] == "gateway"]
    return deployment


def gateway_container() -> dict[str, Any]:
    container: dict[str, Any] = gateway_deployment()["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("version", ["1.28.0", kubernetes_validate.latest_version()])
def test_manifests_are_valid_kubernetes_resources(version: str) -> None:
    assert {p.name for p in MANIFESTS} >= {"gateway.yaml", "redis.yaml"}
    kinds = set()
    for doc in documents():
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.add(doc["kind"])
    assert kinds == {
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "HorizontalPodAutoscaler",
    }


def test_configmap_policy_is_valid_and_mounted_where_the_gateway_reads_it(
    tmp_path: Path,
) -> None:
    (configmap,) = documents("ConfigMap", "gateway.yaml")
    container = gateway_container()
    env = {e["name"]: e.get("value") for e in container["env"]}
    config = PurePosixPath(env["GATEWAY_CONFIG"])
    assert config.name in configmap["data"]
    policy_file = tmp_path / config.name
    policy_file.write_text(configmap["data"][config.name])
    policy = load_and_build(policy_file).policy
    # Mounted as a directory: a subPath mount would never see the ConfigMap's updates.
    spec = gateway_deployment()["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v.get("configMap", {}).get("name"))
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert "subPath" not in mount
    assert str(config.parent) == mount["mountPath"]
    # SIGKILL only after the drain delay and the shutdown deadline.
    server = policy.server
    assert server.drain_delay > 0
    assert spec["terminationGracePeriodSeconds"] > server.drain_delay + server.shutdown_timeout
    # The token file is in a volume the admin-token init container writes (next test).
    token_dir = str(PurePosixPath(env["GATEWAY_ADMIN_TOKEN_FILE"]).parent)
    (token_mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == token_dir]
    (init,) = spec["initContainers"]
    assert any(m["name"] == token_mount["name"] for m in init["volumeMounts"])


def test_deployment_probes_ports_resources_and_user() -> None:
    container = gateway_container()
    env = dockerfile_env()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == split_host_port(env["GATEWAY_LISTEN"])[1]
    assert ports["admin"] == split_host_port(env["GATEWAY_ADMIN_LISTEN"])[1]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    public = ServerSettings().admin_public_paths
    assert "/readyz" in public and "/healthz" in public  # the probes need no token
    assert container["resources"]["requests"].keys() == {"cpu", "memory"}
    from_config_maps = [
        name
        for ref in container.get("envFrom", [])
        for doc in documents("ConfigMap")
        if doc["metadata"]["name"] == ref["configMapRef"]["name"]
        for name in doc["data"]
    ]
    assert from_config_maps == ["GATEWAY_STORE_URL"]
    for name in [e["name"] for e in container["env"]] + from_config_maps:
        assert f'"{name}"' in gateway_source(), f"the Deployment sets {name}, which nothing reads"
    spec = gateway_deployment()["spec"]["template"]["spec"]
    uid = re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert uid is not None
    assert spec["securityContext"]["runAsUser"] == int(uid.group(1))
    (service,) = [s for s in documents("Service") if s["metadata"]["name"] == "gateway"]
    assert service["spec"]["selector"] == gateway_deployment()["spec"]["selector"]["matchLabels"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_the_policy_is_defined_once_for_both_setups() -> None:
    """One policy ConfigMap in all the manifests: redis.yaml names only the store, so the two
    setups cannot drift apart."""
    policies = [
        (path.name, doc["metadata"]["name"])
        for path in MANIFESTS
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None and doc["kind"] == "ConfigMap" and "version: 1" in str(doc["data"])
    ]
    assert policies == [("gateway.yaml", "gateway-policy")]
    (store,) = documents("ConfigMap", "redis.yaml")
    assert store["data"].keys() == {"GATEWAY_STORE_URL"}


def test_the_redis_overlay_puts_the_same_policy_on_redis_and_is_safe_to_autoscale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis.yaml gives gateway.yaml's policy the Redis it runs (GATEWAY_STORE_URL through the
    Deployment's envFrom) and autoscales the gateway: store.replicas is the autoscaler's
    maximum, so with Redis down (on_failure: local) the replicas together never admit more
    than a limit."""
    (store,) = documents("ConfigMap", "redis.yaml")
    refs = [ref["configMapRef"] for ref in gateway_container()["envFrom"]]
    assert {"name": store["metadata"]["name"], "optional": True} in refs
    alone = manifest_policy("gateway.yaml", tmp_path)
    assert alone.store.url == "memory"
    url = store["data"]["GATEWAY_STORE_URL"]
    monkeypatch.setenv("GATEWAY_STORE_URL", url)
    (configmap,) = documents("ConfigMap", "gateway.yaml")
    ((name, text),) = configmap["data"].items()
    (tmp_path / "on-redis").mkdir()
    (tmp_path / "on-redis" / name).write_text(text)
    # As `gateway check` builds it in the pod: the Redis store, short of connecting.
    shared = load_and_build(tmp_path / "on-redis" / name).policy
    assert store_url(shared.store) == url and shared.store.on_failure == "local"
    parts = urlsplit(url)
    (service,) = [s for s in documents("Service") if s["metadata"]["name"] == parts.hostname]
    assert [p["port"] for p in service["spec"]["ports"]] == [parts.port]
    (hpa,) = documents("HorizontalPodAutoscaler", "redis.yaml")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (
        "Deployment",
        gateway_deployment()["metadata"]["name"],
    )
    assert shared.store.replicas == hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"] >= 2


def test_the_image_is_named_once_a_placeholder_the_header_says_how_to_fill() -> None:
    """No registry has the manifests' image: the header says how to build and push it (or
    which the release workflow publishes), and both containers name the same one, tagged with
    the package's version."""
    spec = gateway_deployment()["spec"]["template"]["spec"]
    images = {c["image"] for c in spec["containers"] + spec["initContainers"]}
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert images == {f"registry.example.com/rl-gateway:{version}"}
    header = (ROOT / "deploy" / "kubernetes" / "gateway.yaml").read_text().split("\napiVersion")[0]
    assert "--platform linux/amd64,linux/arm64" in header and "--push ." in header
    assert f"ghcr.io/OWNER/rl-gateway:{version}" in header
    assert "kubectl set image deployment/gateway gateway=IMAGE admin-token=IMAGE" in header


def _run_gateway(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_the_example_applies_without_a_secret_and_still_has_a_token(tmp_path: Path) -> None:
    """The Secret is optional: the init container's command writes the Secret's token when
    there is one, else a random one, where GATEWAY_ADMIN_TOKEN_FILE points; run here with the
    pod's paths under tmp_path."""
    spec = gateway_deployment()["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    secret_volume = next(v for v in spec["volumes"] if "secret" in v)
    assert secret_volume["secret"]["optional"] is True
    command = [str(part) for part in init["command"]]
    assert command[0] == "gateway"
    env = {e["name"]: e.get("value") for e in gateway_container()["env"]}
    token_file = env["GATEWAY_ADMIN_TOKEN_FILE"]
    assert token_file in command
    secret_mount = next(m for m in init["volumeMounts"] if m["name"] == secret_volume["name"])
    given = next(part for part in command if part.startswith(secret_mount["mountPath"] + "/"))

    def local(path: str) -> str:
        return str(tmp_path / path.lstrip("/"))

    (tmp_path / PurePosixPath(token_file).parent.relative_to("/")).mkdir(parents=True)
    argv = [local(part) if part in (token_file, given) else part for part in command[1:]]
    result = _run_gateway(*argv)
    assert result.returncode == 0, result.stderr
    written = Path(local(token_file))
    token = written.read_text().strip()
    assert len(token) >= 32 and written.stat().st_mode & 0o777 == 0o600
    assert token not in result.stdout + result.stderr
    # With the Secret: its token.
    Path(local(given)).parent.mkdir(parents=True)
    Path(local(given)).write_text("the-operators-own-token-0123456789\n")
    result = _run_gateway(*argv)
    assert result.returncode == 0, result.stderr
    assert written.read_text().strip() == "the-operators-own-token-0123456789"
    auth = AdminAuth.of(ServerSettings(), {"GATEWAY_ADMIN_TOKEN_FILE": str(written)})
    assert auth.token == "the-operators-own-token-0123456789"


def test_probes_survive_one_slow_answer_and_unready_comes_within_the_drain_delay(
    tmp_path: Path,
) -> None:
    probe = gateway_container()["readinessProbe"]
    assert probe["failureThreshold"] >= 2  # one slow or lost probe is not an outage
    assert probe["timeoutSeconds"] >= 2
    drain = manifest_policy("gateway.yaml", tmp_path).server.drain_delay
    assert probe["periodSeconds"] * probe["failureThreshold"] <= drain


def test_a_disruption_budget_and_a_network_policy_guard_the_gateway() -> None:
    labels = gateway_deployment()["spec"]["template"]["metadata"]["labels"]
    (budget,) = documents("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # One pod at a time; never minAvailable == replicas, which would block every node drain.
    assert budget["spec"] == {**budget["spec"], "maxUnavailable": 1}
    policy = next(d for d in documents("NetworkPolicy") if d["metadata"]["name"] == "gateway")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    rules = policy["spec"]["ingress"]
    open_ports = [p["port"] for rule in rules if "from" not in rule for p in rule["ports"]]
    assert open_ports == ["http"]  # the admin port is never open to everyone
    (admin,) = [rule for rule in rules if "from" in rule]
    assert [p["port"] for p in admin["ports"]] == ["admin"]
    sources = admin["from"]
    assert {"podSelector": {}} in sources  # this namespace
    prometheus = [s for s in sources if "namespaceSelector" in s]
    assert prometheus and prometheus[0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "prometheus"
    }
    redis_policy = next(d for d in documents("NetworkPolicy") if d["metadata"]["name"] != "gateway")
    ((source,),) = [rule["from"] for rule in redis_policy["spec"]["ingress"]]
    assert source["podSelector"]["matchLabels"].items() <= labels.items()


def test_the_header_says_how_client_addresses_survive_a_load_balancer() -> None:
    text = (ROOT / "deploy" / "kubernetes" / "gateway.yaml").read_text()
    assert "externalTrafficPolicy: Local" in text and "trusted_proxies" in text


# -- the release workflow --------------------------------------------------------------------

WORKFLOWS = ROOT / ".github" / "workflows"


def validate_workflows(*paths: Path) -> subprocess.CompletedProcess[str]:
    """The workflows checked against GitHub's workflow schema (check-jsonschema's vendored copy
    of SchemaStore's, so no network): a misspelt key, a value of the wrong kind or a missing
    required field fails."""
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
         *map(str, paths)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def test_the_workflows_pass_the_workflow_schema_and_it_sees_a_mistake(tmp_path: Path) -> None:
    workflows = sorted(WORKFLOWS.glob("*.y*ml"))
    assert [path.name for path in workflows] == ["release.yml"]
    checked = validate_workflows(*workflows)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = tmp_path / "release.yml"
    broken.write_text((WORKFLOWS / "release.yml").read_text().replace("runs-on:", "run-on:", 1))
    checked = validate_workflows(broken)
    assert checked.returncode == 1 and "'runs-on' is a required property" in checked.stdout


def test_the_release_publishes_the_image_for_the_locked_platforms_on_a_version_tag() -> None:
    workflow = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
    trigger = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert trigger == {"push": {"tags": ["v*.*.*"]}}
    (job,) = workflow["jobs"].values()
    assert job["permissions"] == {"contents": "read", "packages": "write"}
    steps = {step.get("uses", "").split("@")[0]: step for step in job["steps"]}
    build = steps["docker/build-push-action"]["with"]
    assert build["context"] == "." and build["push"] is True
    # The platforms requirements.wheels holds a wheel of every locked package for.
    locked = {line.split()[0] for line in (ROOT / "requirements.wheels").read_text().splitlines()
              if line.strip() and not line.startswith("#")}  # fmt: skip
    as_docker = {"linux-x86_64": "linux/amd64", "linux-aarch64": "linux/arm64"}
    assert set(build["platforms"].split(",")) == {as_docker[p] for p in locked}
    script = "\n".join(step.get("run", "") for step in job["steps"])
    assert 'if [ "$TAG" != "v$version" ]' in script  # the tag is the package's version
    assert "ghcr.io/${OWNER,,}/rl-gateway" in script


def gateway_source() -> str:
    return "\n".join(path.read_text() for path in (ROOT / "gateway").rglob("*.py"))


def _kubelet_update(mount: Path, files: dict[str, str], generation: int) -> None:
    """What the kubelet's atomic writer does: a new timestamped directory, the ``..data``
    link swapped to it by rename, the old directory removed; the visible files are links
    through ``..data``."""
    new = mount / f"..2026_11_24_00_00_0{generation}.{generation}"
    new.mkdir()
    for name, text in files.items():
        (new / name).write_text(text)
    old = (mount / "..data").resolve() if (mount / "..data").exists() else None
    tmp_link = mount / "..data_tmp"
    tmp_link.symlink_to(new.name)
    tmp_link.rename(mount / "..data")
    for name in files:
        if not (mount / name).is_symlink():
            (mount / name).symlink_to(f"..data/{name}")
    if old is not None:
        shutil.rmtree(old)


async def test_configmap_update_through_the_data_swap_reloads_the_policy(
    start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    (configmap,) = documents("ConfigMap", "gateway.yaml")
    name = next(iter(configmap["data"]))
    text = configmap["data"][name] + "  # generation {n}\n"
    text = text.replace("http://backend.default.svc.cluster.local:8000", "http://127.0.0.1:9")
    listeners = "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
    text = text.replace("server:\n", listeners, 1)
    mount = tmp_path / "policies"
    mount.mkdir()
    _kubelet_update(mount, {name: text.format(n=1)}, 1)
    path = mount / name
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    loop = asyncio.get_running_loop()
    for generation in (2, 3):  # twice: the first swap removes the directory first read
        before = gw.gateway.loaded.sha256
        _kubelet_update(mount, {name: text.format(n=generation)}, generation)
        deadline = loop.time() + 10
        while gw.gateway.loaded.sha256 == before:
            assert loop.time() < deadline, f"generation {generation} not reloaded"
            await asyncio.sleep(0.05)
        assert gw.gateway.loaded.sha256 == load_and_build(path).sha256


async def test_a_reload_cannot_move_the_drain_delay(
    start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """The supervisor's kill deadline counts the delay the gateway started with."""
    policy = _drain_policy(0, 0, "1s")
    gw = await start_gateway(policy)
    moved = parse_and_build(policy.replace("drain_delay: 1s", "drain_delay: 30s"), "t.yaml")
    with pytest.raises(ValueError, match=r"server.drain_delay \(1.0 -> 30.0\) takes effect"):
        gw.gateway.apply(moved)
    assert gw.gateway.loaded.policy.server.drain_delay == 1.0
