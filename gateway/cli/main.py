"""Command line: gateway run, gateway check FILE (like nginx -t), gateway schema, gateway
replay LOG... (what a policy would have done to logged traffic).

Every mistake of the user's is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from gateway import __version__
from gateway.admin.keys_cli import add_keys_arguments, run_keys
from gateway.build import build_name
from gateway.cli import listen_addresses
from gateway.cli.supervisor import EXIT_STARTUP, supervise, worker_main
from gateway.engine.preflight import build_problems, load_and_build
from gateway.log_setup import LOG_FORMATS, LOG_LEVELS
from gateway.log_setup import configure as configure_logging
from gateway.policy.loader import LoadedPolicy, Loc, PolicyError
from gateway.policy.models import (
    Policy,
    Route,
    ServerSettings,
    Upstream,
    listeners_collide,
    policy_json_schema,
    split_host_port,
)

if TYPE_CHECKING:
    from gateway.policytest.arrivals import Pattern
    from gateway.replay.gate import Condition

log = logging.getLogger("gateway")

ENV_CONFIG = "GATEWAY_CONFIG"
ENV_LOG_LEVEL = "GATEWAY_LOG_LEVEL"
ENV_LOG_FORMAT = "GATEWAY_LOG_FORMAT"
# A worker that cannot start (its message printed) exits with this: the supervisor stops
# rather than restarting it in a loop.


def _policy_for_upstream(url: str) -> LoadedPolicy:
    """``gateway run --upstream URL``: everything proxied to one backend, no limits."""
    policy = Policy(
        upstreams={"default": Upstream(url=url)},
        routes=(Route(name="default", upstream="default"),),
    )
    return LoadedPolicy(policy=policy, source=f"--upstream {url}", sha256="0" * 64)


def _load_for_run(args: argparse.Namespace) -> LoadedPolicy:
    if args.upstream and args.config:
        raise SystemExit("gateway: give either --config or --upstream, not both")
    if args.upstream:
        try:
            Upstream(url=args.upstream)
        except ValueError as exc:
            raise SystemExit(f"gateway: --upstream: {exc}") from None
        return _policy_for_upstream(args.upstream)
    config = args.config or os.environ.get(ENV_CONFIG)
    if not config:
        raise SystemExit(
            "gateway: no policy: use --config FILE (or GATEWAY_CONFIG), or --upstream URL"
        )
    try:
        return load_and_build(config)
    except PolicyError as exc:
        raise SystemExit(str(exc)) from None


def cmd_run(args: argparse.Namespace) -> int:
    from gateway.serving.lifecycle import (
        ENV_ADMIN_LISTEN,
        StartupError,
        check_aiohttp,
        configured_listeners,
        listen_address,
    )

    check_aiohttp()
    loaded = _load_for_run(args)
    for option, value in (("--listen", args.listen), ("--admin-listen", args.admin_listen)):
        if value is not None:
            try:
                split_host_port(value)
            except ValueError as exc:
                raise SystemExit(f"gateway: {option}: {exc}") from None
    workers = args.workers or loaded.policy.server.workers
    policy_path = None if args.upstream else (args.config or os.environ.get(ENV_CONFIG))
    if workers != loaded.policy.server.workers:
        # --workers overrides the file: build again for that count (the Redis store's local
        # fallback divides each limit by it).
        for _, problem in build_problems(loaded.policy, workers):
            raise SystemExit(f"gateway: --workers {workers}: {problem}")
    server = loaded.policy.server
    try:
        listeners = [address for _, address in configured_listeners(args.listen, server)]
        admin = listen_address(args.admin_listen, ENV_ADMIN_LISTEN, server.admin_listen)
    except StartupError as exc:
        return _startup_error(str(exc))
    refused = _make_auto_token(server, admin) or _open_admin_refusal(loaded, args, admin)
    if refused is not None:
        return _startup_error(refused)
    admin_where = listen_addresses.display(*admin)
    for listen in listeners:
        where = listen_addresses.display(*listen)
        if listeners_collide(where, admin_where):
            # The policy's own are refused with its line; this is an override's doing.
            return _startup_error(
                f"the proxy ({where}) and the admin listener ({admin_where}) take the same "
                "port: give the admin listener a port of its own"
            )
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(
                listen_addresses.held(
                    [*(("proxy", *listen) for listen in listeners), ("admin", *admin)]
                )
            )
        except listen_addresses.AddressHeld as exc:
            return _startup_error(str(exc))
        if workers == 1:
            worker_main(loaded, args.listen, args.admin_listen, 0, 1, policy_path)
            return 0
        return supervise(loaded, workers, args.listen, args.admin_listen, policy_path)


def _make_auto_token(server: ServerSettings, admin: tuple[str, int]) -> str | None:
    """``GATEWAY_ADMIN_TOKEN_AUTO_FILE``: the token an admin listener off loopback would lack,
    written once, before the workers start, and read by them (and every reload) through
    ``GATEWAY_ADMIN_TOKEN_FILE``. Returns what stops the start, if anything."""
    from gateway.admin.auth import ENV_TOKEN_AUTO_FILE, ENV_TOKEN_FILE
    from gateway.admin.token_file import TokenFileError, auto_token_file, write_token_file

    path = auto_token_file(server, admin)
    if path is None:
        return None
    try:
        origin = write_token_file(path, keep=True)
    except TokenFileError as exc:
        return f"{ENV_TOKEN_AUTO_FILE}: {exc}"
    os.environ[ENV_TOKEN_FILE] = path
    log.info(
        "admin listener on %s is off loopback and no admin token was given: %s in %s (%s); "
        "read it there (docker exec CONTAINER cat %s)",
        listen_addresses.display(*admin),
        "using the token kept" if origin == "kept" else "made a random one",
        path,
        ENV_TOKEN_AUTO_FILE,
        path,
    )
    return None


def _open_admin_refusal(
    loaded: LoadedPolicy, args: argparse.Namespace, admin: tuple[str, int]
) -> str | None:
    """An admin listener off loopback with no token, refused before any worker starts (each
    would refuse it alike: ``Gateway`` checks it too)."""
    from gateway.admin.auth import AdminTokenError, open_admin_refusal, resolve_admin_token
    from gateway.serving.lifecycle import ENV_ADMIN_LISTEN, listen_source

    try:
        token = resolve_admin_token(loaded.policy.server)
    except AdminTokenError:
        return None  # the worker says why, as it does for every token it cannot use
    source = listen_source(args.admin_listen, ENV_ADMIN_LISTEN, "admin_listen")
    refusal = open_admin_refusal(admin, source, token, loaded.policy.server)
    return None if refusal is None else f"{loaded.source}: {refusal}"


def _startup_error(message: str) -> int:
    """What a worker that cannot start says and exits with (a restart would fail alike)."""
    sys.stderr.write(f"gateway: {message}\n")
    return EXIT_STARTUP


def listen_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """The policy's listen addresses that ``run`` could not bind here, tried as ``nginx -t``
    does (one in use is fine: it may be this very gateway's). An address the environment
    overrides (``GATEWAY_LISTEN``, ``GATEWAY_ADMIN_LISTEN``) is not the one ``run`` binds."""
    from gateway.serving.lifecycle import ENV_ADMIN_LISTEN, ENV_LISTEN

    problems: list[tuple[Loc, str]] = []
    server = policy.server
    tried: list[tuple[Loc, str]] = []
    if isinstance(server.listen, str):
        if not os.environ.get(ENV_LISTEN):
            tried.append((("server", "listen"), server.listen))
    else:  # a list names every address itself: GATEWAY_LISTEN does not replace it
        tried += [
            (("server", "listen", index, "address"), listener.address)
            for index, listener in enumerate(server.listen)
        ]
    if not os.environ.get(ENV_ADMIN_LISTEN):
        tried.append((("server", "admin_listen"), server.admin_listen))
    for loc, address in tried:
        problem = listen_addresses.check_problem(*split_host_port(address))
        if problem is not None:
            problems.append((loc, problem))
    return problems


def admin_token_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """The admin token ``run`` would refuse to start with (a file it cannot read, an empty
    one, a token too short), read as ``run`` reads it: the environment's first."""
    from gateway.admin.auth import ENV_TOKEN, ENV_TOKEN_FILE, AdminTokenError, resolve_admin_token

    try:
        resolve_admin_token(policy.server)
    except AdminTokenError as exc:
        from_environment = os.environ.get(ENV_TOKEN) or os.environ.get(ENV_TOKEN_FILE)
        field = "admin_token_file" if policy.server.admin_token_file else "admin_token"
        return [(() if from_environment else ("server", field), str(exc))]
    return []


def access_log_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """An access log file ``run`` could not open for appending, seen without creating it."""
    settings = policy.server.access_log_settings()
    if settings is None or settings.path is None:
        return []
    path = Path(settings.path)
    if path.exists():
        if path.is_dir() or not os.access(path, os.W_OK):
            return [(("server", "access_log", "path"), f"cannot append to {path}")]
    elif not path.parent.is_dir() or not os.access(path.parent, os.W_OK | os.X_OK):
        return [
            (
                ("server", "access_log", "path"),
                f"cannot create {path}: its directory is missing or not writable",
            )
        ]
    return []


def open_admin_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """An admin listener ``run`` would refuse: off loopback (its address the environment's
    first, as ``run`` reads it) with no token, unless ``server.admin_insecure`` or
    ``GATEWAY_ADMIN_TOKEN_AUTO_FILE`` (``run`` makes the token there)."""
    from gateway.admin.auth import (
        ENV_TOKEN_AUTO_FILE,
        AdminTokenError,
        open_admin_refusal,
        resolve_admin_token,
    )
    from gateway.serving.lifecycle import ENV_ADMIN_LISTEN, listen_source

    if os.environ.get(ENV_TOKEN_AUTO_FILE):
        return []
    try:
        admin = split_host_port(os.environ.get(ENV_ADMIN_LISTEN) or policy.server.admin_listen)
        token = resolve_admin_token(policy.server)
    except (ValueError, AdminTokenError):  # said by run, or by admin_token_problems
        return []
    source = listen_source(None, ENV_ADMIN_LISTEN, "admin_listen")
    refusal = open_admin_refusal(admin, source, token, policy.server)
    if refusal is None:
        return []
    return [(() if os.environ.get(ENV_ADMIN_LISTEN) else ("server", "admin_listen"), refusal)]


def check_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """What ``run`` refuses beyond building the policy: listen addresses, the admin token, an
    admin listener open off loopback, an access log file it could not open."""
    return (
        listen_problems(policy)
        + admin_token_problems(policy)
        + open_admin_problems(policy)
        + access_log_problems(policy)
    )


def cmd_check(args: argparse.Namespace) -> int:
    failed = False
    for file in args.files:
        if _cases_file(file):
            failed = _check_cases_file(file, args) or failed
            continue
        try:
            loaded = load_and_build(file, also=check_problems)
        except PolicyError as exc:
            print(exc, file=sys.stderr)
            failed = True
        else:
            for line in loaded.warning_lines():
                print(line, file=sys.stderr)
            print(f"{file}: ok (sha256 {loaded.sha256[:12]})")
            if not args.no_tests:
                failed = _run_sibling_cases(file, loaded) or failed
    return 1 if failed else 0


def _cases_file(file: str) -> bool:
    from gateway.policytest.case_command import SIBLING_SUFFIX

    return file.endswith(SIBLING_SUFFIX)


def _check_cases_file(file: str, args: argparse.Namespace) -> bool:
    """A policy's test cases named to check (``policies/*.yaml`` names them beside their
    policy): run with their policy, once; True when that fails. Without a policy beside it, a
    clear line saying how to run it."""
    from gateway.policytest.case_command import SIBLING_SUFFIX, run_and_report

    policy = file[: -len(SIBLING_SUFFIX)] + ".yaml"
    if not Path(policy).is_file():
        print(
            f"{file}: test cases (the name ends in {SIBLING_SUFFIX}), not a policy, and no "
            f"{Path(policy).name} beside them: run them with `gateway test POLICY {file}`",
            file=sys.stderr,
        )
        return True
    if args.no_tests:
        print(f"{file}: the test cases of {policy}, not run (--no-tests)")
        return False
    if any(Path(named) == Path(policy) for named in args.files):
        print(f"{file}: the test cases of {policy}, run with it")
        return False
    try:
        loaded = load_and_build(policy, also=check_problems)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return True
    print(f"{file}: the test cases of {policy}")
    return run_and_report(loaded, file) != 0


def _run_sibling_cases(file: str, loaded: LoadedPolicy) -> bool:
    """The policy's test cases, when they sit beside it (``policy.tests.yaml``): True when
    one fails or the file is invalid."""
    from gateway.policytest.case_command import run_and_report, sibling_cases

    cases = sibling_cases(file)
    if cases is None:
        return False
    print(f"{cases}: the policy's tests")
    return run_and_report(loaded, str(cases)) != 0


def cmd_test(args: argparse.Namespace) -> int:
    from gateway.policytest.case_command import main as test_main

    return test_main(args.policy, args.cases, args.junit)


def cmd_healthcheck(args: argparse.Namespace) -> int:
    from gateway.admin.healthcheck import HealthcheckError, healthcheck

    try:
        print(healthcheck(args.config, args.path, args.timeout))
    except HealthcheckError as exc:
        print(f"gateway healthcheck: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    return run_keys(args)


def cmd_admin_token(args: argparse.Namespace) -> int:
    from gateway.admin.token_file import TokenFileError, write_token_file

    try:
        origin = write_token_file(args.file, getattr(args, "from"), keep=args.keep)
    except TokenFileError as exc:
        print(f"gateway admin-token: {exc}", file=sys.stderr)
        return 1
    said = {"given": f"the token of {getattr(args, 'from')}", "kept": "the token it held"}
    print(f"gateway admin-token: {args.file}: {said.get(origin, 'a new random token')}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(policy_json_schema(), indent=2, ensure_ascii=False))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from gateway.policy.units import parse_duration
    from gateway.replay import main as replay_main

    try:
        window_s = parse_duration(args.reorder_window)
    except ValueError as exc:
        raise SystemExit(f"gateway replay: --reorder-window: {exc}") from None
    return replay_main(
        args.logs,
        args.config,
        compare=args.compare,
        fmt=args.format,
        forwarded_for=args.forwarded_for,
        as_json=args.json,
        html_file=args.html,
        top=args.top,
        window_s=window_s,
        progress=False if args.no_progress else None,
        fail_if=args.fail_if,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    from gateway.policytest.pattern_command import main as simulate_main

    return simulate_main(
        args.policy,
        args.pattern,
        headers=tuple(args.header or ()),
        html_file=args.html,
        png_file=args.png,
        as_json=args.json,
        compare=args.compare,
    )


def cmd_suggest(args: argparse.Namespace) -> int:
    from gateway.suggest.suggest_command import main as suggest_main

    status = suggest_main(
        args.logs,
        output=args.output,
        share=args.reject_at_most,
        fmt=args.format,
        api_key_header=args.api_key_header,
        protect_upstream=args.protect_upstream,
        upstream=args.upstream,
        html_file=args.html,
        of_requests=args.of == "requests",
    )
    if status:
        return status
    # As gateway check would: the policy, then the cases written beside it.
    return 1 if _run_sibling_cases(args.output, load_and_build(args.output)) else 0


_DESCRIPTION = """\
A rate-limiting reverse proxy: nginx limit_req semantics, layered limits, live reload.
"""

_EPILOG = """\
examples:
  gateway run --config policies/default.yaml
  gateway run --config policy.yaml --listen 0.0.0.0:8080 --log-format json
  gateway run --upstream http://127.0.0.1:8000        (no limits, no policy file)
  gateway check policy.yaml other.toml                (and policy.tests.yaml beside it)
  gateway test policy.yaml cases.yaml --junit results.xml
  gateway simulate policy.yaml --pattern burst:size=20,every=10s,for=1m --html sim.html
  gateway suggest access.log --reject-at-most 1% -o suggested.yaml --html evidence.html
  gateway schema > policy.schema.json
  gateway healthcheck                                 (the image's HEALTHCHECK)
  gateway replay --config candidate.yaml --compare policy.yaml access.log.gz
  gateway keys list per_key --top 10                  (the most used keys of a limit)
  gateway keys block per_key --key K --for 15m --reason "abuse report"

environment:
  GATEWAY_CONFIG      policy file when --config is not given
  GATEWAY_LOG_LEVEL   default of --log-level (INFO)
  GATEWAY_LOG_FORMAT  default of --log-format (text)
  GATEWAY_STORE_URL   overrides the policy's store.url (memory, shared, redis://...)
  GATEWAY_METRICS_DIR where --workers N processes share their metrics
  GATEWAY_SHARED_DIR  where --workers N processes share their limit state (/dev/shm)
  GATEWAY_LOOP        asyncio to use the standard event loop instead of uvloop
  GATEWAY_LISTEN      proxy listener, over the policy's server.listen (the image: 0.0.0.0:8080)
  GATEWAY_ADMIN_LISTEN admin listener, over server.admin_listen (the image: 0.0.0.0:9090)
  GATEWAY_IN_CONTAINER set by the image: a loopback listener is logged as unreachable
  GATEWAY_ADMIN_TOKEN  the admin listener's bearer token (over server.admin_token)
  GATEWAY_ADMIN_TOKEN_FILE a file holding it, read at start and on every reload
  GATEWAY_ADMIN_TOKEN_AUTO_FILE where run writes a random token (kept there) when the
                       admin listener is off loopback and none is given
                       (the image: /run/gateway/admin-token)
"""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, naming --help, rather than the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid log level {text!r}: expected one of {', '.join(LOG_LEVELS)}"
        )
    return level


def _add_log_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The logging options, accepted before and after the subcommand alike; after it they
    have no defaults of their own, so they override only when given."""
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=os.environ.get(ENV_LOG_LEVEL, "INFO") if defaults else argparse.SUPPRESS,
        help=f"{', '.join(LOG_LEVELS)} (default: ${ENV_LOG_LEVEL} or INFO)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get(ENV_LOG_FORMAT, "text") if defaults else argparse.SUPPRESS,
        help=f"the gateway's own log lines as text or as one JSON object per line "
        f"(default: ${ENV_LOG_FORMAT} or text)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gateway",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"gateway {__version__} ({build_name()})"
    )
    _add_log_options(parser, defaults=True)
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{run,check,test,simulate,suggest,schema,healthcheck,replay,admin-token,keys}",
    )

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        child = sub.add_parser(
            name,
            help=summary,
            description=summary,
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_log_options(child, defaults=False)
        return child

    run = command("run", "serve a policy")
    run.add_argument("--config", "-c", help="policy file (YAML, or TOML by extension)")
    run.add_argument("--upstream", help="proxy everything to this URL, no limits (no policy file)")
    run.add_argument("--listen", help="HOST:PORT for the proxy, overriding the policy file")
    run.add_argument("--admin-listen", help="HOST:PORT for the admin listener")
    run.add_argument(
        "--workers", type=_positive_int, help="processes sharing the port (SO_REUSEPORT)"
    )
    run.set_defaults(func=cmd_run)

    check = command("check", "validate policy files, like nginx -t")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument(
        "--no-tests",
        action="store_true",
        help="do not run the cases beside a policy (FILE.tests.yaml): accept what run accepts",
    )
    check.set_defaults(func=cmd_check)

    health = command(
        "healthcheck",
        "probe this gateway's admin listener (GATEWAY_ADMIN_LISTEN, else the policy's "
        "admin_listen): exit 0 on 200",
    )
    health.add_argument("--config", "-c", help="policy file (default: GATEWAY_CONFIG)")
    health.add_argument("--path", default="/readyz", help="admin path to probe")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds")
    health.set_defaults(func=cmd_healthcheck)

    token = command(
        "admin-token",
        "write an admin token to FILE for GATEWAY_ADMIN_TOKEN_FILE (mode 0600, never printed): "
        "--from's when that file exists, else (--keep) the one FILE holds, else a random one",
    )
    token.add_argument("file", metavar="FILE")
    token.add_argument("--from", metavar="SECRET", help="a mounted secret holding the token")
    token.add_argument("--keep", action="store_true", help="keep the token FILE already holds")
    token.set_defaults(func=cmd_admin_token)

    test = command(
        "test",
        "run a policy's test cases (requests at virtual instants, and what must come of them) "
        "on the real engine: exit 1 with a diff when one fails",
    )
    test.add_argument("policy", metavar="POLICY", help="the policy file")
    test.add_argument("cases", metavar="CASES", help="the cases file (YAML)")
    test.add_argument("--junit", metavar="FILE", help="write the results as JUnit XML, for CI")
    test.set_defaults(func=cmd_test)

    sim = command(
        "simulate",
        "run arrival patterns (constant, burst, poisson, ramp, or a log) against a policy on a "
        "virtual clock: admitted, delayed and rejected over time, each limit's level, drawn",
    )
    sim.add_argument("policy", metavar="POLICY", help="the policy file")
    sim.add_argument(
        "--pattern",
        action="append",
        required=True,
        type=_arrival_pattern,
        metavar="PATTERN",
        help="constant:rate=10r/s,for=30s | burst:size=20,every=10s,for=1m | "
        "poisson:rate=10r/s,for=1m,seed=1 | ramp:from=1r/s,to=50r/s,for=1m | log:FILE; "
        "each takes start=, path=, client=, clients=N, method= (repeatable: superimposed)",
    )
    sim.add_argument(
        "--header",
        action="append",
        type=_header,
        metavar="'NAME: VALUE'",
        help="a header every generated request carries (repeatable)",
    )
    sim.add_argument(
        "--compare", metavar="FILE", help="a second policy under the same requests, drawn beside"
    )
    sim.add_argument("--html", metavar="FILE", help="write a self-contained HTML page")
    sim.add_argument("--png", metavar="FILE", help="write a PNG (needs matplotlib)")
    sim.add_argument("--json", action="store_true", help="print one JSON document")
    sim.set_defaults(func=cmd_simulate)

    suggest = command(
        "suggest",
        "propose limits from access logs (per client, per API key, per path prefix, overall), "
        "each number with its evidence; write them as a policy and replay it as proof",
    )
    suggest.add_argument("logs", nargs="+", help="access logs, as replay reads them (gzip too)")
    suggest.add_argument(
        "--output", "-o", default="suggested.yaml", help="the policy to write (suggested.yaml)"
    )
    suggest.add_argument(
        "--reject-at-most",
        type=_share,
        default=0.01,
        metavar="SHARE",
        help="the share a per-key limit may refuse, of the keys (at their peaks) or of the "
        "requests (--of) (1%%)",
    )
    suggest.add_argument(
        "--of",
        choices=("keys", "requests"),
        default="keys",
        help="what --reject-at-most is a share of (keys)",
    )
    suggest.add_argument(
        "--protect-upstream",
        type=_per_second,
        metavar="N",
        help="the most requests a second the upstream takes (N or Nr/s): the global limit",
    )
    suggest.add_argument(
        "--api-key-header",
        default="X-Api-Key",
        metavar="NAME",
        help="the header carrying API keys, when the log has headers (X-Api-Key)",
    )
    suggest.add_argument(
        "--upstream", default="http://127.0.0.1:8000", help="the upstream the policy names"
    )
    suggest.add_argument(
        "--format",
        choices=("auto", "combined", "gateway", "jsonl"),
        default="auto",
        help="log format (default: detected from the first line)",
    )
    suggest.add_argument("--html", metavar="FILE", help="write the evidence and proof as HTML")
    suggest.set_defaults(func=cmd_suggest)

    keys = command(
        "keys",
        "a limit's keys over the admin listener: list (the most used first), show one, "
        "reset, block or unblock one (each change logged with its --reason)",
    )
    add_keys_arguments(keys)
    keys.set_defaults(func=cmd_keys)

    schema = command("schema", "print the policy file JSON Schema")
    schema.set_defaults(func=cmd_schema)

    replay = command(
        "replay", "what a policy would have done to logged traffic (on a simulated clock)"
    )
    replay.add_argument("logs", nargs="+", help="access logs (gzip too; '-' is stdin)")
    replay.add_argument("--config", "-c", required=True, help="the policy to replay")
    replay.add_argument("--compare", metavar="FILE", help="a second policy, side by side")
    replay.add_argument(
        "--format",
        choices=("auto", "combined", "gateway", "jsonl"),
        default="auto",
        help="log format (default: detected from the first line)",
    )
    replay.add_argument(
        "--forwarded-for",
        action="store_true",
        help="take the client from the log's X-Forwarded-For field, when it has one",
    )
    replay.add_argument("--json", action="store_true", help="print one JSON document")
    replay.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    replay.add_argument(
        "--top", type=_positive_int, default=10, help="keys and clients listed (10)"
    )
    replay.add_argument(
        "--reorder-window",
        default="30s",
        help="how far out of order log lines may be (lines are written when requests end)",
    )
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    replay.add_argument(
        "--fail-if",
        action="append",
        type=_fail_condition,
        metavar="CONDITION",
        help="exit 1 when the policy's replay meets it, for CI: 'rejected > 1%%', "
        "'delayed >= 500', 'per_ip.rejected > 0.5%%' (repeatable)",
    )
    replay.set_defaults(func=cmd_replay)
    return parser


def _arrival_pattern(text: str) -> Pattern:
    from gateway.policytest.arrivals import PatternError, parse_pattern

    try:
        return parse_pattern(text)
    except PatternError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _header(text: str) -> tuple[str, str]:
    name, colon, value = text.partition(":")
    if not colon or not name.strip() or " " in name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def _share(text: str) -> float:
    number = text.strip().removesuffix("%")
    try:
        value = float(number) / (100.0 if text.strip().endswith("%") else 1.0)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share such as 1% or 0.01, got {text!r}")
    return value


def _per_second(text: str) -> float:
    number = text.strip().removesuffix("r/s").strip()
    try:
        value = float(number)
    except ValueError:
        value = 0.0
    if value <= 0.0:
        raise argparse.ArgumentTypeError(
            f"expected requests a second such as 200 or 200r/s, got {text!r}"
        )
    return value


def _fail_condition(text: str) -> Condition:
    from gateway.replay.gate import GateError, parse_condition

    try:
        return parse_condition(text)
    except GateError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    for name in (ENV_LOG_LEVEL, ENV_LOG_FORMAT):
        # A bad default from the environment is a usage error too, not a traceback.
        value = os.environ.get(name)
        if value is not None:
            try:
                if name == ENV_LOG_LEVEL:
                    _log_level(value)
                elif value not in LOG_FORMATS:
                    raise argparse.ArgumentTypeError(
                        f"invalid log format {value!r}: expected one of {', '.join(LOG_FORMATS)}"
                    )
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{name}: {exc}")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
