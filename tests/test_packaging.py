"""Static checks of the Dockerfile, deploy/compose/docker-compose.yml, README and CI script.

No Docker engine runs on our build machines, so these files are parsed rather than built.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import tomllib
from importlib import metadata
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from gateway.engine.preflight import load_and_build
from gateway.policy.models import split_host_port
from tests.support.dockerfile import dockerfile_env, dockerfile_instructions, final_stage

ROOT = Path(__file__).parent.parent
COMPOSE = ROOT / "deploy" / "compose"


def test_dockerfile_uses_slim_python_base() -> None:
    base = final_stage()[0][1]
    assert re.match(r"python:3\.1[1-9]-slim", base), base


def test_dockerfile_runs_as_non_root_user() -> None:
    users = [rest for k, rest in final_stage() if k == "USER"]
    assert users, "no USER in the final stage"
    assert users[-1] not in {"root", "0", "0:0"}


def test_dockerfile_entrypoint_and_healthcheck_are_exec_form() -> None:
    stage = dict(final_stage())
    entrypoint = json.loads(stage["ENTRYPOINT"])
    assert entrypoint[:2] == ["gateway", "run"]
    # Settings come from ENV, so a CMD of the operator's (--config FILE) keeps them.
    assert json.loads(stage.get("CMD", "[]")) == []
    healthcheck = stage["HEALTHCHECK"]
    cmd = healthcheck.split(" CMD ", 1)[1]
    # The probe reads the admin address where the gateway does (tests/test_deploy.py runs it).
    assert json.loads(cmd) == ["gateway", "healthcheck"]


def test_dockerfile_exposes_the_ports_it_listens_on() -> None:
    stage = final_stage()
    exposed = {p for k, rest in stage if k == "EXPOSE" for p in rest.split()}
    env = dockerfile_env()
    listen = split_host_port(env["GATEWAY_LISTEN"])
    admin = split_host_port(env["GATEWAY_ADMIN_LISTEN"])
    assert listen[0] == admin[0] == "0.0.0.0"
    assert {str(listen[1]), str(admin[1])} <= exposed


def test_dockerfile_default_policy_is_not_under_the_mount_point() -> None:
    """Mounting /etc/gateway/policies must not hide the policy GATEWAY_CONFIG names."""
    config = dockerfile_env()["GATEWAY_CONFIG"]
    assert not config.startswith("/etc/gateway/policies/")
    copies = [rest.split() for k, rest in final_stage() if k == "COPY" and "--from" not in rest]
    assert any(config.startswith(dst.rstrip("/") + "/") for *_, dst in copies)


def test_dockerfile_sets_only_environment_variables_the_gateway_reads() -> None:
    source = "\n".join(path.read_text() for path in (ROOT / "gateway").rglob("*.py"))
    for name in dockerfile_env():
        if name.startswith("GATEWAY_"):
            assert f'"{name}"' in source, f"the Dockerfile sets {name}, which nothing reads"


def test_compose_services_match_the_policy() -> None:
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"gateway", "redis", "backend"} <= set(services)
    gateway = services["gateway"]
    config_path = gateway["environment"]["GATEWAY_CONFIG"]
    mount_src, mount_dst = gateway["volumes"][0].split(":")[:2]
    assert config_path.startswith(mount_dst)
    policy_file = COMPOSE / mount_src / config_path[len(mount_dst) :].lstrip("/")
    policy = load_and_build(policy_file).policy

    published = {int(p.split(":")[-1]) for p in gateway["ports"]}
    assert split_host_port(policy.server.listen)[1] in published
    assert split_host_port(policy.server.admin_listen)[1] in published
    for upstream in policy.upstreams.values():
        parts = urlsplit(upstream.url)
        assert parts.hostname in services, f"{parts.hostname} is not a compose service"
        service = services[parts.hostname]
        assert str(parts.port) in [str(p).split(":")[-1] for p in service.get("expose", [])]
    for url in (policy.store.url, gateway["environment"]["GATEWAY_STORE_URL"]):
        parts = urlsplit(url)
        assert parts.scheme == "redis"
        assert parts.hostname in services, f"{parts.hostname} is not a compose service"
        assert str(parts.port) in [str(p) for p in services[parts.hostname].get("expose", [])]


def test_compose_publishes_the_admin_port_on_the_host_loopback_only() -> None:
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    gateway = compose["services"]["gateway"]
    policy = load_and_build(ROOT / "policies" / "compose.yaml").policy
    admin_port = split_host_port(policy.server.admin_listen)[1]
    for mapping in gateway["ports"]:
        host_part, _, container_port = str(mapping).rpartition(":")
        if int(container_port) == admin_port:
            assert host_part.startswith("127.0.0.1:"), f"admin port published as {mapping}"
    assert any(str(m).endswith(f":{admin_port}") for m in gateway["ports"])


def test_compose_publishes_nothing_but_the_proxy_beyond_the_host_loopback() -> None:
    """The admin port, Prometheus and Grafana (anonymous viewer, admin/admin) on 127.0.0.1."""
    policy = load_and_build(ROOT / "policies" / "compose.yaml").policy
    proxy_port = split_host_port(policy.server.listen)[1]
    published = []
    for name in ("docker-compose.yml", "docker-compose.observability.yml"):
        for service, spec in yaml.safe_load((COMPOSE / name).read_text())["services"].items():
            for mapping in spec.get("ports", []):
                published.append((service, str(mapping)))
    assert {service for service, _ in published} == {"gateway", "prometheus", "grafana"}
    for service, mapping in published:
        if mapping == f"{proxy_port}:{proxy_port}":
            continue
        assert mapping.startswith("127.0.0.1:"), f"{service} publishes {mapping} on every interface"


def test_compose_sets_an_admin_token_from_a_file_the_admin_token_service_writes() -> None:
    services = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    gateway, maker = services["gateway"], services["admin-token"]
    token_file = PurePosixPath(gateway["environment"]["GATEWAY_ADMIN_TOKEN_FILE"])
    mounts = {m.split(":")[1]: m.split(":")[0] for m in gateway["volumes"]}
    volume = mounts[str(token_file.parent)]
    assert gateway["volumes"][list(mounts).index(str(token_file.parent))].endswith(":ro")
    assert f"{volume}:{token_file.parent}" in maker["volumes"]
    assert maker["entrypoint"][:3] == ["gateway", "admin-token", str(token_file)]
    assert "--keep" in maker["entrypoint"]  # one token for the volume's life
    assert gateway["depends_on"]["admin-token"] == {"condition": "service_completed_successfully"}


def test_compose_builds_the_image_once_at_the_root_and_every_service_runs_it() -> None:
    """One service builds (the Dockerfile stays at the root, where `docker build .` expects
    it); the others run that image by its name and never pull it."""
    services = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    builders = [name for name, spec in services.items() if "build" in spec]
    assert builders == ["gateway"]
    assert (COMPOSE / services["gateway"]["build"]).resolve() == ROOT.resolve()
    assert (ROOT / "Dockerfile").is_file()
    image = services["gateway"]["image"]
    ours = [name for name, spec in services.items() if spec.get("image") == image]
    assert set(ours) == {"gateway", "admin-token", "backend"}
    for name in set(ours) - {"gateway"}:
        assert services[name]["pull_policy"] == "never", name
    assert all(not (ROOT / name).exists() for name in ("docker-compose.yml", "compose.yaml"))


def test_compose_backend_is_the_demo_upstream_not_a_file_server() -> None:
    backend = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]["backend"]
    command = [*backend["entrypoint"], *backend["command"]]
    assert command[:3] == ["python", "-m", "gateway.serving.demo_upstream"]
    assert "http.server" not in " ".join(command)


def test_compose_sets_only_environment_variables_the_gateway_reads() -> None:
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    source = "\n".join(path.read_text() for path in (ROOT / "gateway").rglob("*.py"))
    for name in compose["services"]["gateway"].get("environment", {}):
        assert f'"{name}"' in source, f"docker-compose.yml sets {name}, which nothing reads"


def _dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, enough for these patterns: the last matching pattern wins, ``!`` negates,
    a pattern matching a directory excludes what is under it."""
    ignored = False
    parts = PurePosixPath(path).parts
    prefixes = [str(PurePosixPath(*parts[: i + 1])) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        if any(
            fnmatch.fnmatch(p, glob)
            or (glob.startswith("**/") and fnmatch.fnmatch(PurePosixPath(p).name, glob[3:]))
            for p in prefixes
        ):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_venv_and_git_out_of_the_build_context() -> None:
    patterns = _dockerignore_patterns()
    for path in (
        ".git",
        ".git/objects/ab",
        ".venv",
        ".venv/bin/python",
        "tests/test_cli.py",
        "gateway/__pycache__/cli.cpython-311.pyc",
        "test-artifacts/shot.png",
        ".env",
    ):
        assert _ignored(path, patterns), f"{path} would be sent to the Docker daemon"
    # Everything the Dockerfile copies stays in the context.
    for keyword, rest in dockerfile_instructions():
        if keyword == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert not _ignored(source, patterns), f"COPY {source} but .dockerignore drops it"
    assert not _ignored("gateway/cli/main.py", patterns)
    assert not _ignored("gateway/lua/leaky_bucket.lua", patterns)


def _locked() -> dict[str, tuple[str, list[str]]]:
    """requirements.lock: name -> (version, hashes)."""
    locked: dict[str, tuple[str, list[str]]] = {}
    text = (ROOT / "requirements.lock").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert not line.startswith("-"), f"an option in the lock file: {line}"
        requirement, *options = line.split()
        name, sep, version = requirement.partition("==")
        assert sep, f"not pinned with ==: {line}"
        hashes = [o.removeprefix("--hash=") for o in options if o.startswith("--hash=sha256:")]
        assert hashes and len(hashes) == len(options), f"no hash, or another option: {line}"
        locked[canonicalize_name(name)] = (version, hashes)
    return locked


def test_lock_file_pins_every_runtime_dependency_with_hashes() -> None:
    """Every package `rl-gateway[speed]` needs, transitively, is in requirements.lock at a
    version its requirers accept, so the image build resolves nothing itself."""
    locked = _locked()
    pending = [(requirement, "speed") for requirement in metadata.requires("rl-gateway") or []]
    seen = set()
    while pending:
        text, extra = pending.pop()
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate(
            {"extra": extra, "sys_platform": "linux", "python_version": "3.11"}
        ):
            continue
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{name} (needed: {text}) is not in requirements.lock"
        version = locked[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (text, version)
        for wanted in sorted(requirement.extras) or [""]:
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            pending += [(r, wanted) for r in metadata.requires(name) or []]
    assert set(locked) == {name for name, _ in seen}, "requirements.lock has stale entries"


# The platforms the image is built for (python:3.11-slim: Debian, glibc): each must install
# every locked package from a wheel whose hash the lock holds (no compiler in the image).
IMAGE_PLATFORMS = ("x86_64", "aarch64")


def _wheel_installs_on(filename: str, arch: str) -> bool:
    """Whether CPython 3.11 on glibc Linux ``arch`` installs this wheel."""
    _, _, _, tags = parse_wheel_filename(filename)
    for tag in tags:
        python_ok = tag.interpreter in ("py3", "py311", "cp311") or (
            tag.abi == "abi3"
            and tag.interpreter.startswith("cp3")
            and int(tag.interpreter[3:]) <= 11
        )
        abi_ok = tag.abi in ("none", "abi3", "cp311")
        platform_ok = tag.platform == "any" or (
            tag.platform.startswith("manylinux") and tag.platform.endswith("_" + arch)
        )
        if python_ok and abi_ok and platform_ok:
            return True
    return False


def test_the_lock_installs_from_wheels_on_x86_64_and_aarch64() -> None:
    """requirements.wheels (scripts/lock_wheels.py: pip download --require-hashes for each
    platform) names, per platform, the wheel of every locked package; each must fit that
    platform and its hash be in the lock, or the image build fails there ("Expected sha256
    ... Got ...") or falls back to an sdist it cannot compile."""
    locked = _locked()
    chosen: dict[str, dict[str, str]] = {f"linux-{arch}": {} for arch in IMAGE_PLATFORMS}
    for line in (ROOT / "requirements.wheels").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        platform, filename, digest = line.split()
        name, version, _, _ = parse_wheel_filename(filename)
        assert platform in chosen, line
        assert _wheel_installs_on(filename, platform.removeprefix("linux-")), line
        assert locked[name][0] == str(version), f"{filename}: the lock pins {locked[name][0]}"
        assert f"sha256:{digest}" in locked[name][1], f"{filename}: its hash is not in the lock"
        chosen[platform][name] = filename
    for platform, wheels in chosen.items():
        assert set(wheels) == set(locked), f"{platform}: no wheel for {set(locked) - set(wheels)}"


def test_image_installs_from_the_lock_file_with_hashes_required() -> None:
    build = [rest for k, rest in dockerfile_instructions() if k == "RUN" and "pip wheel" in rest]
    assert any("--require-hashes" in r and "-r requirements.lock" in r for r in build), build
    # The project's own wheel adds nothing unlocked, and the final install resolves nothing.
    assert all("--require-hashes" in r or "--no-deps" in r for r in build), build
    install = [rest for k, rest in final_stage() if k == "RUN" and "pip install" in rest]
    assert install and all("--no-index" in r and "--no-deps" in r for r in install), install


def test_license_file_is_the_apache_2_0_text_pyproject_declares() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in text
    assert "http://www.apache.org/licenses/" in text
    for section in range(1, 10):
        assert f"\n   {section}. " in text, f"section {section} missing"
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    # Byte for byte the text apache.org publishes (LICENSE-2.0.txt, which Debian ships as
    # common-licenses/Apache-2.0).
    digest = hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest()
    assert digest == "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme
    assert "scripts/test.sh" in ci
    script = (ROOT / "scripts" / "test.sh").read_text()
    for package in ("nginx", "redis-server"):
        assert package in script


def test_readme_run_command_is_the_demo_script() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/demo.sh" in readme
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "policies/default.yaml" in demo
    # Both set-up scripts install into a virtual environment: Debian's python3 refuses a
    # system-wide pip install (PEP 668).
    for script in ("demo.sh", "test.sh"):
        assert ". scripts/python-env.sh" in (ROOT / "scripts" / script).read_text()
