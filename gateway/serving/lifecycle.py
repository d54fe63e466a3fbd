"""Process lifecycle: start the listeners, serve until SIGTERM/SIGINT, then drain gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from gateway.admin.app import AdminState, make_admin_app
from gateway.admin.auth import (
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    AdminAuth,
    AdminTokenError,
    is_loopback,
    open_admin_refusal,
)
from gateway.clock import Clock
from gateway.edge.client_errors import ClientErrorLog
from gateway.edge.proxy import ProxyHandler
from gateway.edge.redirect import HttpsRedirect
from gateway.edge.runtime import Runtime, build_runtime, largest_body_size, uses_demo
from gateway.edge.server import GatewayServer
from gateway.edge.tls import ListenerTls, TlsListeners
from gateway.observability.dashboard import install as install_dashboard
from gateway.observability.observer import Observability
from gateway.observability.snapshot_files import default_shared_dir
from gateway.observability.worker import WorkerState
from gateway.policy.loader import LoadedPolicy, format_loc
from gateway.policy.models import (
    Listener,
    Policy,
    ServerSettings,
    StoreSettings,
    TlsSettings,
    split_host_port,
)
from gateway.policy.tls_files import TlsFilesError, listener_tls_loc, load_tls
from gateway.redact import redact_text, redact_url
from gateway.serving.accept_site import AcceptSite
from gateway.serving.demo_upstream import DemoUpstream
from gateway.serving.heap import freeze_startup_heap, refreeze_heap
from gateway.serving.reload import PolicyReloader
from gateway.stores import LimitStore, build_store, store_url
from gateway.stores.shared.runtime_dir import SharedDirError

log = logging.getLogger("gateway")

MIN_AIOHTTP = (3, 14, 5)

# Listen addresses from the environment, between the command line and the policy file: a
# container image sets them once, and neither a mounted policy copied from default.yaml (which
# listens on loopback) nor a `--config` command replaces them.
ENV_LISTEN = "GATEWAY_LISTEN"
ENV_ADMIN_LISTEN = "GATEWAY_ADMIN_LISTEN"
# Set by the image: a loopback listener there is unreachable from outside the container.
ENV_IN_CONTAINER = "GATEWAY_IN_CONTAINER"


def listen_address(flag: str | None, env_name: str, from_policy: str) -> tuple[str, int]:
    """``--listen``, else the environment variable, else the policy file."""
    env_value = os.environ.get(env_name) or None
    try:
        return split_host_port(flag or env_value or from_policy)
    except ValueError as exc:
        source = "the command line" if flag else env_name if env_value else "the policy file"
        raise StartupError(f"{source}: {exc}") from None


def configured_listeners(
    flag: str | None, settings: ServerSettings
) -> tuple[tuple[Listener, tuple[str, int]], ...]:
    """The proxy's listeners and where each binds. One listen address: ``--listen``, else
    ``GATEWAY_LISTEN``, else the policy's. A list of listeners names every address itself:
    ``--listen`` is refused, ``GATEWAY_LISTEN`` not used (``serve`` says so)."""
    if isinstance(settings.listen, str):
        (listener,) = settings.listeners
        return ((listener, listen_address(flag, ENV_LISTEN, settings.listen)),)
    if flag:
        raise StartupError(
            "--listen: the policy's server.listen is a list of listeners: change their "
            "addresses there"
        )
    return tuple((listener, split_host_port(listener.address)) for listener in settings.listen)


@dataclass(eq=False)
class ProxyListener:
    """One listener of the proxy in this worker: its settings, where it binds, its TLS or its
    redirect, and the port it got."""

    settings: Listener
    host: str
    port: int
    tls: ListenerTls | None = None
    redirect: HttpsRedirect | None = None
    bound_port: int = 0

    @property
    def where(self) -> str:
        return _host_port(self.host, self.bound_port or self.port)


def listen_source(flag: str | None, env_name: str, field: str) -> str:
    """Where ``listen_address`` found the address, for a message about it."""
    if flag:
        return "the command line"
    return env_name if os.environ.get(env_name) else f"server.{field}"


def in_container() -> bool:
    """Our image says so (``GATEWAY_IN_CONTAINER``), and so does any Kubernetes pod. Not
    ``/.dockerenv``: development containers, where loopback is what you want, have it too."""
    if os.environ.get(ENV_IN_CONTAINER, "") not in ("", "0"):
        return True
    return "KUBERNETES_SERVICE_HOST" in os.environ


def check_aiohttp() -> None:
    """Refuse versions with known request-smuggling bugs, and the pure-Python parser."""
    version = tuple(int(p) for p in aiohttp.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_AIOHTTP:
        raise SystemExit(
            f"gateway: aiohttp {aiohttp.__version__} is too old; "
            f"{'.'.join(map(str, MIN_AIOHTTP))} or later is required (request-smuggling fixes)"
        )
    from aiohttp import http_parser

    if http_parser.HttpRequestParser.__module__ != "aiohttp._http_parser":
        raise SystemExit(
            "gateway: aiohttp is using its pure-Python HTTP parser "
            "(AIOHTTP_NO_EXTENSIONS set, or the C extension is missing); refusing to start"
        )


class StartupError(Exception):
    """The gateway cannot start for a reason the operator can fix (a port already in use)."""


async def _start_site(site: web.TCPSite, what: str, host: str, port: int) -> None:
    try:
        await site.start()
    except OSError as exc:
        # asyncio's strerror repeats the address; the errno's text says it plainly.
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        address = _host_port(host, port)
        raise StartupError(f"cannot listen on {address} ({what}): {reason}") from None


class Gateway:
    """One worker's listeners and runtime; tests start it in process, the CLI per worker.

    Built in one pass (inside a running event loop): every part exists once ``__init__``
    returns and each is handed only what it reads; ``start`` binds the listeners.
    """

    def __init__(
        self,
        loaded: LoadedPolicy,
        *,
        listen: str | None = None,
        admin_listen: str | None = None,
        reuse_port: bool = False,
        worker_id: int = 0,
        workers: int = 1,
        clock: Clock | None = None,
        store: LimitStore | None = None,
        policy_path: str | None = None,
        supervisor_pid: int | None = None,
    ) -> None:
        settings = loaded.policy.server
        self.loaded = loaded
        self.listeners = [
            ProxyListener(listener, *address)
            for listener, address in configured_listeners(listen, settings)
        ]
        first = next(listener for listener in self.listeners if not listener.settings.redirects)
        self.listen = first.host, first.port
        self.admin_listen = listen_address(admin_listen, ENV_ADMIN_LISTEN, settings.admin_listen)
        try:
            self.admin_auth = AdminAuth.of(settings)
        except AdminTokenError as exc:
            raise StartupError(str(exc)) from None
        self._admin_source = listen_source(admin_listen, ENV_ADMIN_LISTEN, "admin_listen")
        refusal = open_admin_refusal(
            self.admin_listen, self._admin_source, self.admin_auth.token, settings
        )
        if refusal is not None:
            raise StartupError(f"{loaded.source}: {refusal}")
        self.reuse_port = reuse_port
        self.worker_id = worker_id
        self.workers = workers
        self.proxy_port = 0
        self.admin_port = 0
        try:
            self.store: LimitStore = store or build_store(
                loaded.policy.store, clock, workers, open_shared=True, worker_id=worker_id
            )
        except ValueError as exc:  # a store URL the client refuses; it may hold a password
            raise StartupError(f"store: {redact_text(str(exc))}") from None
        except SharedDirError as exc:  # no room, read-only, not a directory
            raise StartupError(str(exc)) from None
        for index, listener in enumerate(self.listeners):
            tls = listener.settings.tls
            if tls is not None:
                try:
                    listener.tls = ListenerTls(tls, loaded.source)
                except TlsFilesError as exc:
                    where = format_loc(listener_tls_loc(settings, index, exc.index))
                    raise StartupError(f"{where}: {exc}") from None
            elif listener.settings.redirects:
                to = listener.settings.redirect_to_https
                listener.redirect = HttpsRedirect(
                    0 if to is True else int(to), listener.settings.redirect_status
                )
        served = [listener.tls for listener in self.listeners if listener.tls is not None]
        self.tls = TlsListeners(served) if served else None
        self._demo = DemoUpstream() if uses_demo(loaded) else None
        self._demo_address = self._demo.address if self._demo is not None else None
        self._watch_stop = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._tls_watchers: list[asyncio.Task[None]] = []
        self._retired: list[Runtime] = []

        level = logging.getLevelNamesMapping()[settings.client_error_log_level.upper()]
        self._client_errors = (
            ClientErrorLog("proxy", level, clock),
            ClientErrorLog("admin", level, clock),
        )
        try:
            self.handler = ProxyHandler(build_runtime(loaded, self.store, self._demo_address))
            self.server = GatewayServer(
                self.handler,
                header_timeout=settings.header_timeout,
                max_connections=settings.max_connections,
                max_body_size=largest_body_size(loaded.policy),
                legacy_error_body=settings.error_body == "legacy",
                keepalive_timeout=settings.keepalive_timeout,
                max_line_size=settings.max_header_size,
                max_field_size=settings.max_header_size,
                max_headers=settings.max_headers,
                auto_decompress=False,
                access_log=None,  # the observability wrapper writes the access log line
                logger=self._client_errors[0],
            )
            self.reloader = (
                PolicyReloader(
                    policy_path,
                    running=lambda: self.loaded,
                    apply=self.apply,
                    refresh=self.refresh_files,
                )
                if policy_path
                else None
            )
            self.observability = Observability(
                WorkerState(
                    worker_id=worker_id,
                    current=self.handler,
                    store=self.store,
                    connections=self.server,
                    reloader=self.reloader,
                    tls=self.tls,
                    # The access log's ``t_us``: the limiter's instants (the store's clock).
                    limiter_clock=self.store.clock,
                ),
                shared_dir=default_shared_dir(reuse_port),
            )
            self.observability.wrap(self.handler)
            try:
                self.observability.access_log.configure(loaded.policy)
            except OSError as exc:
                raise StartupError(f"server.access_log.path: {_cannot_open(exc)}") from None
            self.admin_state = AdminState(
                handler=self.handler,
                worker_id=worker_id,
                reloader=self.reloader,
                auth=self.admin_auth,
                # POST /reload reaches one worker of several: the supervisor's SIGHUP reloads
                # the others too (a rotated token must stop working on every one).
                reload_siblings=(
                    functools.partial(_signal, supervisor_pid, signal.SIGHUP)
                    if supervisor_pid is not None
                    else None
                ),
            )
            admin_app = make_admin_app(self.admin_state)
            install_dashboard(admin_app, self.observability)
            self._proxy_runner = web.ServerRunner(
                self.server, shutdown_timeout=settings.shutdown_timeout
            )
            # A redirecting listener has a server of its own: its handler answers every request.
            self._redirect_runners = [
                (
                    listener,
                    web.ServerRunner(
                        self._redirect_server(listener.redirect, settings),
                        shutdown_timeout=settings.shutdown_timeout,
                    ),
                )
                for listener in self.listeners
                if listener.redirect is not None
            ]
            self._admin_runner = web.AppRunner(
                admin_app, access_log=None, logger=self._client_errors[1]
            )
        except BaseException:
            if self._demo is not None:
                self._demo.discard()  # its port was bound for the runtime just built
            raise

    def _redirect_server(self, redirect: HttpsRedirect, settings: ServerSettings) -> GatewayServer:
        """The server of a redirecting listener, with the proxy's protections against slow
        clients (it reads no body)."""
        return GatewayServer(
            redirect,
            header_timeout=settings.header_timeout,
            max_connections=settings.max_connections,
            keepalive_timeout=settings.keepalive_timeout,
            max_line_size=settings.max_header_size,
            max_field_size=settings.max_header_size,
            max_headers=settings.max_headers,
            auto_decompress=False,
            access_log=None,
            logger=self._client_errors[0],
        )

    async def _bind(self, runner: web.BaseRunner, listener: ProxyListener) -> int:
        """Open one listener's site on ``runner`` (each worker its own socket, SO_REUSEPORT
        with --workers N), accepting every waiting connection at once (``accept_site``); the
        port it got."""
        tls = listener.tls
        timeout = self.loaded.policy.server.header_timeout if tls is not None else None
        site = AcceptSite(
            runner,
            listener.host,
            listener.port,
            backlog=1024,
            reuse_port=self.reuse_port or None,
            ssl_context=tls.context if tls is not None else None,
            handshake_timeout=timeout,
        )
        what = "redirect to https" if listener.redirect is not None else "proxy"
        await _start_site(site, what, listener.host, listener.port)
        return site.port

    async def start(self) -> None:
        if self._demo is not None:
            await self._demo.start()
        # Before the listeners open: no request pays for connecting to the store.
        await self.store.prepare()
        await self.handler.runtime.prepare()
        self.handler.runtime.start()
        await self._proxy_runner.setup()
        for listener in self.listeners:
            if listener.redirect is None:
                listener.bound_port = await self._bind(self._proxy_runner, listener)
        # Redirects to `true` go to the first TLS listener's port, known once it is bound.
        https_port = next((lsn.bound_port for lsn in self.listeners if lsn.tls is not None), 0)
        for listener, runner in self._redirect_runners:
            assert listener.redirect is not None
            if listener.settings.redirect_to_https is True:
                listener.redirect.port = https_port
            await runner.setup()
            listener.bound_port = await self._bind(runner, listener)
        self.proxy_port = next(
            listener.bound_port for listener in self.listeners if listener.redirect is None
        )

        await self._admin_runner.setup()
        admin_host, admin_port = self.admin_listen
        admin_site = web.TCPSite(
            self._admin_runner, admin_host, admin_port, reuse_port=self.reuse_port or None
        )
        await _start_site(admin_site, "admin", admin_host, admin_port)
        self.admin_port = self._admin_runner.addresses[0][1]
        self.admin_state.in_force = {
            "listen": self._listen_in_force(),
            "admin_listen": _host_port(admin_host, self.admin_port),
            "workers": self.workers,
            "shutdown_timeout": self.loaded.policy.server.shutdown_timeout,
        }
        if self.reloader is not None:
            self._watcher = asyncio.get_running_loop().create_task(
                self.reloader.watch(self._watch_stop)
            )
        for listener in self.listeners:
            if listener.tls is not None:
                self._tls_watchers.append(
                    asyncio.get_running_loop().create_task(listener.tls.watch(self._watch_stop))
                )
        self.admin_state.ready = True

    def _listen_in_force(self) -> object:
        """``listen`` as bound: the address, or each listener with its address."""
        if isinstance(self.loaded.policy.server.listen, str):
            return _host_port(self.listen[0], self.proxy_port)
        return [
            {**listener.settings.model_dump(mode="json"), "address": listener.where}
            for listener in self.listeners
        ]

    def apply(self, loaded: LoadedPolicy) -> None:
        """Swap in a new policy; raises (and changes nothing) if it cannot be built.

        Requests in flight finish under the runtime they started with; its upstream pools that
        the new runtime does not share are closed once those requests are done.
        """
        if uses_demo(loaded) and self._demo_address is None:
            raise ValueError("builtin:demo can only be used if the gateway started with it")
        moved = restart_only_changes(self.loaded.policy, loaded.policy)
        if moved:
            takes, them = ("takes", "it") if len(moved) == 1 else ("take", "them")
            raise ValueError(
                f"{loaded.source}: {', '.join(moved)} {takes} effect on restart only; the running "
                f"policy stays (restart the gateway to apply {them}, or revert {them} to reload "
                "the rest)"
            )
        if (loaded.policy.server.tls is None) != (self.loaded.policy.server.tls is None):
            raise ValueError(
                "server.tls on or off takes effect on restart only; the running policy stays"
            )
        # Each TLS listener whose certificates changed: all of them loaded before anything
        # changes (TlsFilesError, a ValueError: the reload refused whole).
        renewed: list[tuple[ListenerTls, TlsSettings]] = []
        pairs = zip(
            self.listeners,
            self.loaded.policy.server.listeners,
            loaded.policy.server.listeners,
            strict=True,
        )
        for listener, before, after in pairs:
            if listener.tls is not None and after.tls is not None:
                if after.tls != before.tls:
                    load_tls(after.tls, loaded.source)
                if after.tls != before.tls or loaded.source != self.loaded.source:
                    renewed.append((listener.tls, after.tls))
        # The token file is read again, so a reload (SIGHUP) rotates the token.
        admin_auth = AdminAuth.of(loaded.policy.server)
        refusal = open_admin_refusal(
            self.admin_listen, self._admin_source, admin_auth.token, loaded.policy.server
        )
        if refusal is not None:
            raise ValueError(f"{loaded.source}: {refusal}; the running policy stays")
        access_log = self.observability.access_log
        try:
            log_file = access_log.open_for(loaded.policy)
        except OSError as exc:
            raise ValueError(
                f"{loaded.source}: server.access_log.path: {_cannot_open(exc)}; the running "
                "policy stays"
            ) from None
        previous = self.handler.runtime
        try:
            runtime = build_runtime(loaded, self.store, self._demo_address, previous=previous)
        except BaseException:
            access_log.discard(log_file)
            raise
        access_log.use(loaded.policy, log_file)
        self.handler.runtime = runtime
        runtime.start()
        self.server.reconfigure(loaded.policy.server)
        self.server.max_body_size = largest_body_size(loaded.policy)
        for _, runner in self._redirect_runners:
            if isinstance(runner.server, GatewayServer):
                runner.server.reconfigure(loaded.policy.server)
        for listener_tls, tls_settings in renewed:
            listener_tls.reload(tls_settings, loaded.source)
        level = logging.getLevelNamesMapping()[loaded.policy.server.client_error_log_level.upper()]
        for client_errors in self._client_errors:
            client_errors.client_level = level
        self.loaded = loaded
        self._swap_admin_auth(admin_auth)
        asyncio.get_running_loop().create_task(self._retire(previous))

    def refresh_files(self) -> bool:
        """Read again the files the running policy names but whose content is not in its
        digest: the admin token's and the JWT key's. True if either changed what is in force."""
        token = self.refresh_admin_token()
        identity = self.handler.runtime.engine.identity
        key = identity is not None and identity.reread_key()
        return token or key

    def refresh_admin_token(self) -> bool:
        """Read the admin token (its file) again under the running policy: a reload whose
        policy is unchanged still rotates the token. True if it changed; ``AdminTokenError``
        (the file gone, empty, too short) changes nothing."""
        return self._swap_admin_auth(AdminAuth.of(self.loaded.policy.server))

    def _swap_admin_auth(self, admin_auth: AdminAuth) -> bool:
        """From now on the old token and the cookies made from it open nothing."""
        if admin_auth == self.admin_auth:
            return False
        self.admin_auth = admin_auth
        self.admin_state.auth = admin_auth
        return True

    async def _retire(self, runtime: Runtime) -> None:
        """Once ``runtime`` serves no request, close its pools that no other runtime holds.

        A pool can outlive several reloads (its upstream unchanged) and be held by more than
        one retired runtime at once: whichever of them goes idle last closes it, since an older
        one may still have requests on it after a newer one is done with it.
        """
        self._retired.append(runtime)
        try:
            await runtime.idle()
        finally:
            self._retired.remove(runtime)
        in_use = {
            id(target.pool)
            for other in (self.handler.runtime, *self._retired)
            for target in other.upstreams.values()
        }
        await runtime.close(
            keep={name for name, t in runtime.upstreams.items() if id(t.pool) in in_use}
        )
        refreeze_heap()

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish within the shutdown deadline.

        Safe after a failed ``start``: only what was set up is cleaned up."""
        self.admin_state.ready = False
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.cancel()
        for watcher in self._tls_watchers:
            watcher.cancel()
        # Queued requests that could not be served before the deadline get 503 now, rather
        # than being cut off when it passes.
        deadline = asyncio.get_running_loop().time() + max(
            self.loaded.policy.server.shutdown_timeout - 0.5, 0.0
        )
        for runtime in (self.handler.runtime, *self._retired):
            runtime.engine.queue.release_after(deadline)
        for _, runner in self._redirect_runners:
            if runner.server is not None:
                await runner.cleanup()
        if self._proxy_runner.server is not None:
            await self._proxy_runner.cleanup()
        if self._admin_runner.server is not None:
            await self._admin_runner.cleanup()
        await self.handler.runtime.close()
        for runtime in list(self._retired):
            await runtime.close()
        # What the last responses cost, charged before the store closes.
        for runtime in (self.handler.runtime, *self._retired):
            await runtime.engine.charges_done()
        await self.store.close()
        if self._demo is not None:
            await self._demo.close()
        self.observability.access_log.close()

    def reopen_logs(self) -> None:
        """SIGUSR1, as nginx: the access log's file opened again (logrotate renamed it)."""
        try:
            log.info("SIGUSR1: %s", self.observability.access_log.reopen())
        except OSError as exc:
            log.error(
                "SIGUSR1: cannot reopen the access log: %s; still writing to the file it had",
                _cannot_open(exc),
            )


def _cannot_open(exc: OSError) -> str:
    return f"cannot open {exc.filename}: {exc.strerror or exc}"


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone: its workers are stopping too
        os.kill(pid, signum)


def _tls_in_words(tls: ListenerTls | None) -> str:
    """' over TLS (certificate F, valid until D)' for a TLS listener: a client speaking plain
    HTTP to it gets no answer, so the start line says which protocol the port speaks."""
    if tls is None:
        return ""
    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(tls.not_after))
    if tls.certificates == 1:
        return f" over TLS (certificate {tls.files[0]}, valid until {until})"
    return (
        f" over TLS ({tls.certificates} certificates chosen by SNI, default {tls.files[0]}, "
        f"the first to expire valid until {until})"
    )


def _listeners_in_words(listeners: list[ProxyListener]) -> str:
    """Each listener as the start line says it: its address, and TLS or where it redirects."""
    return ", ".join(
        f"{listener.where} (redirects to https port {listener.redirect.port})"
        if listener.redirect is not None
        else f"{listener.where}{_tls_in_words(listener.tls)}"
        for listener in listeners
    )


def _store_in_words(name: str, url: str) -> str:
    """The store as the start line names it: the URL, and the shared store that ``memory``
    becomes with --workers N (as /policy says: store shared, store_url memory)."""
    return f"{name} (store.url {url})" if name == "shared" and url != "shared" else url


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# Server settings a running worker cannot change: its sockets are bound, its processes forked,
# and its runner holds the shutdown deadline (the supervisor's kill deadline adds the drain
# delay it started with). The rest apply on reload.
RESTART_ONLY = ("admin_listen", "workers", "shutdown_timeout", "drain_delay")


def _listener_layout(server: ServerSettings) -> tuple[tuple[object, ...], ...]:
    """What of the listeners only a restart moves: their addresses, TLS on or off, redirects
    (their certificates apply on reload)."""
    return tuple(
        (
            listener.address,
            listener.tls is None,
            repr(listener.redirect_to_https),  # True is 1 to ==, and port 1 is not the TLS one
            listener.redirect_status,
        )
        for listener in server.listeners
    )


def _listen_moved(running: ServerSettings, new: ServerSettings) -> list[str]:
    if isinstance(running.listen, str) and isinstance(new.listen, str):
        if running.listen == new.listen:
            return []  # TLS on or off is said apart
        return [f"server.listen ({running.listen!r} -> {new.listen!r})"]
    if _listener_layout(running) == _listener_layout(new):
        return []
    return ["server.listen (the listeners' addresses, TLS on or off, or redirects)"]


def restart_only_changes(running: Policy, new: Policy) -> list[str]:
    """``server.*`` and ``store.*`` settings that differ between two policies but only move on
    restart (a store URL shown without its password)."""
    moved = _listen_moved(running.server, new.server) + [
        f"server.{name} ({getattr(running.server, name)!r} -> {getattr(new.server, name)!r})"
        for name in RESTART_ONLY
        if getattr(running.server, name) != getattr(new.server, name)
    ]
    for name in StoreSettings.model_fields:
        before, after = getattr(running.store, name), getattr(new.store, name)
        if before != after:
            if name == "url":
                before, after = redact_url(before), redact_url(after)
            moved.append(f"store.{name} ({before!r} -> {after!r})")
    return moved


async def serve(
    loaded: LoadedPolicy,
    *,
    listen: str | None = None,
    admin_listen: str | None = None,
    reuse_port: bool = False,
    worker_id: int = 0,
    workers: int = 1,
    on_started: Callable[[Gateway], None] | None = None,
    policy_path: str | None = None,
    supervisor_pid: int | None = None,
) -> None:
    gateway = Gateway(
        loaded,
        listen=listen,
        admin_listen=admin_listen,
        reuse_port=reuse_port,
        worker_id=worker_id,
        workers=workers,
        policy_path=policy_path,
        supervisor_pid=supervisor_pid,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await gateway.start()
    except StartupError:
        await gateway.stop()  # whatever had started (a listener bound before the other failed)
        raise
    freeze_startup_heap()  # this process serves from here on (not a gateway started in tests)
    tasks: set[asyncio.Task[str]] = set()
    reloader = gateway.reloader
    if reloader is not None:

        def on_sighup() -> None:
            if gateway.tls is not None:  # nginx reads its certificates again on HUP too
                for listener_tls in gateway.tls.listeners:
                    listener_tls.reload()
            task = loop.create_task(reloader.reload())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        loop.add_signal_handler(signal.SIGHUP, on_sighup)
    else:
        # nginx reloads on HUP; with no policy file there is nothing to reload, and the
        # signal's default action would end the process.
        loop.add_signal_handler(
            signal.SIGHUP, lambda: log.info("SIGHUP: no policy file to reload (--upstream)")
        )

    loop.add_signal_handler(signal.SIGUSR1, gateway.reopen_logs)

    admin_host = gateway.admin_listen[0]
    if admin_host in ("0.0.0.0", "::", ""):
        admin_host = "127.0.0.1"  # a wildcard: this machine reaches it on loopback
    log.info(
        "worker %d serving on %s (admin %s:%d), policy %s sha256 %s, store %s; "
        "dashboard http://%s/dashboard/",
        worker_id,
        _listeners_in_words(gateway.listeners),
        gateway.admin_listen[0],
        gateway.admin_port,
        loaded.source,
        loaded.sha256[:12],
        _store_in_words(gateway.store.name, redact_url(store_url(loaded.policy.store))),
        _host_port(admin_host, gateway.admin_port),
    )
    if gateway.admin_auth.token is not None:
        log.info(
            "admin listener requires the admin token (except on %s)",
            ", ".join(gateway.admin_auth.public_paths) or "no path",
        )
    warn_if_unreachable(gateway)
    if not isinstance(loaded.policy.server.listen, str) and os.environ.get(ENV_LISTEN):
        log.warning(
            "%s (%s) is not used: the policy's server.listen is a list of listeners, each with "
            "its own address",
            ENV_LISTEN,
            os.environ[ENV_LISTEN],
        )
    if worker_id == 0:  # one line per warning, not one per worker
        for line in loaded.warning_lines():
            log.warning("%s", line)
    if worker_id == 0:
        warn_if_admin_open(gateway)
    if on_started is not None:
        on_started(gateway)
    try:
        await stop.wait()
        await drain(gateway, stop)
    finally:
        log.info("worker %d shutting down", worker_id)
        for task in list(tasks):
            task.cancel()
        await gateway.stop()


def warn_if_unreachable(gateway: Gateway) -> None:
    """Loopback inside a container is unreachable from outside it: say so loudly, since the
    gateway otherwise looks healthy (its own HEALTHCHECK answers from inside)."""
    if not in_container():
        return
    for what, (host, port), env_name in (
        *(("proxy", (listener.host, listener.port), ENV_LISTEN) for listener in gateway.listeners),
        ("admin", gateway.admin_listen, ENV_ADMIN_LISTEN),
    ):
        if is_loopback(host):
            log.warning(
                "UNREACHABLE: the %s listener is on %s:%d, a loopback address inside a "
                "container: nothing outside the container can connect to it; listen on "
                "0.0.0.0:%d (%s, or server.%s in the policy)",
                what,
                host,
                port,
                port,
                env_name,
                "listen" if what == "proxy" else "admin_listen",
            )


def warn_if_admin_open(gateway: Gateway) -> None:
    """``server.admin_insecure`` let an admin listener off loopback start with no token: said
    at every start, so it is never forgotten."""
    host, port = gateway.admin_listen
    if gateway.admin_auth.token is None and not is_loopback(host):
        log.warning(
            "INSECURE: the admin listener on %s has no admin token and is off loopback "
            "(server.admin_insecure: true): anyone who reaches it can read the policy and "
            "reload it; give it a token (%s or %s) or listen on 127.0.0.1",
            _host_port(host, port),
            ENV_TOKEN,
            ENV_TOKEN_FILE,
        )


async def drain(gateway: Gateway, stop: asyncio.Event) -> None:
    """After SIGTERM: ``/readyz`` answers 503 for ``server.drain_delay`` while the listeners
    still serve, so a load balancer takes the gateway out of rotation before connections are
    refused. A second SIGTERM or SIGINT ends the wait early."""
    delay = gateway.loaded.policy.server.drain_delay
    if delay <= 0 or gateway.admin_state is None:
        return
    gateway.admin_state.ready = False
    log.info("draining: /readyz answers 503 for %gs before the listeners close", delay)
    stop.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), delay)


def run_event_loop(main: Callable[[], object]) -> None:
    """Run a coroutine factory on uvloop when installed (unless ``GATEWAY_LOOP=asyncio``)."""
    try:
        if os.environ.get("GATEWAY_LOOP", "uvloop") == "asyncio":
            raise ImportError("asyncio loop requested")
        import uvloop
    except ImportError:
        asyncio.run(main())  # type: ignore[arg-type]
    else:
        uvloop.run(main())  # type: ignore[arg-type]
