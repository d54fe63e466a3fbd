"""The worker supervisor of ``gateway run --workers N``: fork the workers, forward signals,
restart a worker that dies, stop them all on SIGTERM."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import time
from typing import Any

from gateway.observability.snapshot_files import ENV_METRICS_DIR, supervisor_dir
from gateway.policy.loader import LoadedPolicy
from gateway.stores import shared_store_selected
from gateway.stores.shared.runtime_dir import clean_runtime_dir, runtime_dir

EXIT_STARTUP = 78  # EX_CONFIG: a worker could not start (a port in use, say); no restart

log = logging.getLogger("gateway")


def worker_main(
    loaded: LoadedPolicy,
    listen: str | None,
    admin: str | None,
    worker_id: int,
    workers: int,
    policy_path: str | None,
    startup_errors: multiprocessing.SimpleQueue[str] | None = None,
) -> None:
    from gateway.serving.lifecycle import StartupError, run_event_loop, serve

    try:
        run_event_loop(
            lambda: serve(
                loaded,
                listen=listen,
                admin_listen=admin,
                reuse_port=workers > 1,
                worker_id=worker_id,
                workers=workers,
                policy_path=policy_path,
            )
        )
    except StartupError as exc:
        if startup_errors is not None:
            # The supervisor says it, once: the workers of --workers N fail alike, at once.
            startup_errors.put(f"gateway: {exc}")
        else:
            sys.stderr.write(f"gateway: {exc}\n")
            sys.stderr.flush()
        raise SystemExit(EXIT_STARTUP) from None


def _forked_worker_main(*args: Any) -> None:
    """A worker forked by the supervisor: drop the supervisor's signal handlers first (until
    the worker's event loop installs its own, HUP is ignored and TERM/INT stop it at once)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    worker_main(*args)


def supervise(
    loaded: LoadedPolicy,
    workers: int,
    listen: str | None,
    admin: str | None,
    policy_path: str | None,
) -> int:
    """Run ``workers`` processes on one port (SO_REUSEPORT); restart any that die."""
    ctx = multiprocessing.get_context("fork")
    stopping = False
    startup_errors: multiprocessing.SimpleQueue[str] = ctx.SimpleQueue()

    def start(worker_id: int) -> multiprocessing.process.BaseProcess:
        proc = ctx.Process(
            target=_forked_worker_main,
            args=(loaded, listen, admin, worker_id, workers, policy_path, startup_errors),
            name=f"gateway-worker-{worker_id}",
        )
        proc.start()
        return proc

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def on_sighup(signum: int, frame: object) -> None:
        # Each worker reloads the policy file on its own SIGHUP (nginx: HUP to the master).
        for proc in procs.values():
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGHUP)

    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    shared_dir = None
    if shared_store_selected(loaded.policy.store, workers):
        # The workers' shared limit state starts empty, as in-process state does.
        shared_dir = runtime_dir(os.getpid())
        clean_runtime_dir(shared_dir)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_sighup)
    procs.update({i: start(i) for i in range(workers)})
    log.info("supervisor pid %d started %d workers", os.getpid(), workers)
    failed = False
    while not stopping:
        time.sleep(0.2)
        for worker_id, proc in list(procs.items()):
            if not proc.is_alive() and proc.exitcode == EXIT_STARTUP and not stopping:
                # It said why (a port in use, say); a restart would fail the same way.
                stopping = failed = True
            elif not proc.is_alive() and not stopping:
                log.error("worker %d exited with %s; restarting", worker_id, proc.exitcode)
                time.sleep(0.5)
                procs[worker_id] = start(worker_id)
    for proc in procs.values():
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
    server = loaded.policy.server
    deadline = time.monotonic() + server.drain_delay + server.shutdown_timeout + 5
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
    if shared_dir is not None:
        shutil.rmtree(shared_dir, ignore_errors=True)
    if not os.environ.get(ENV_METRICS_DIR):
        # The workers' snapshots; a directory the operator named is theirs to keep.
        shutil.rmtree(supervisor_dir(os.getpid()), ignore_errors=True)
    said: set[str] = set()
    while not startup_errors.empty():
        message = startup_errors.get()
        if message not in said:
            said.add(message)
            sys.stderr.write(message + "\n")
    sys.stderr.flush()
    return 1 if failed else 0
