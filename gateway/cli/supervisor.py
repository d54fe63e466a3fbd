"""The worker supervisor of ``gateway run --workers N``: fork the workers, forward signals,
restart a worker that dies, stop them all on SIGTERM. Workers do not outlive it: a worker
whose supervisor is gone (killed with SIGKILL, say) stops as on SIGTERM."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import time
from typing import Final

from gateway.observability.snapshot_files import ENV_METRICS_DIR, supervisor_dir
from gateway.policy.loader import LoadedPolicy
from gateway.stores import shared_store_selected
from gateway.stores.shared.runtime_dir import (
    SharedDirError,
    claim_runtime_dir,
    release_runtime_dir,
    runtime_dir,
)

EXIT_STARTUP = 78  # EX_CONFIG: a worker could not start (a port in use, say); no restart
_PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>
PARENT_POLL_S: Final = 1.0

log = logging.getLogger("gateway")


def worker_main(
    loaded: LoadedPolicy,
    listen: str | None,
    admin: str | None,
    worker_id: int,
    workers: int,
    policy_path: str | None,
    supervisor_pid: int | None = None,
    signalled_on_parent_death: bool = False,
    startup_errors: multiprocessing.SimpleQueue[str] | None = None,
) -> None:
    from gateway.serving.lifecycle import StartupError, run_event_loop, serve

    # Until the event loop handles it (reopen the access log), SIGUSR1 must not end the
    # process, as its default action would: logrotate may send it at any time.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    async def main() -> None:
        watch = None
        if supervisor_pid is not None:
            watch = asyncio.get_running_loop().create_task(
                _watch_parent(supervisor_pid, stop=not signalled_on_parent_death)
            )
        try:
            await serve(
                loaded,
                listen=listen,
                admin_listen=admin,
                reuse_port=workers > 1,
                worker_id=worker_id,
                workers=workers,
                policy_path=policy_path,
                supervisor_pid=supervisor_pid,
            )
        finally:
            if watch is not None:
                watch.cancel()

    try:
        run_event_loop(main)
    except StartupError as exc:
        if startup_errors is not None:
            # The supervisor says it, once: the workers of --workers N fail alike, at once.
            startup_errors.put(f"gateway: {exc}")
        else:
            sys.stderr.write(f"gateway: {exc}\n")
            sys.stderr.flush()
        raise SystemExit(EXIT_STARTUP) from None


def _forked_worker_main(
    loaded: LoadedPolicy,
    listen: str | None,
    admin: str | None,
    worker_id: int,
    workers: int,
    policy_path: str | None,
    supervisor_pid: int,
    startup_errors: multiprocessing.SimpleQueue[str],
) -> None:
    """A worker forked by the supervisor: drop the supervisor's signal handlers first (until
    the worker's event loop installs its own, HUP is ignored and TERM/INT stop it at once),
    and have the kernel send SIGTERM when the supervisor dies."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signalled = _die_with_parent(signal.SIGTERM)
    if os.getppid() != supervisor_pid:
        sys.exit(0)  # it died before the request above: nothing will send the signal
    worker_main(
        loaded,
        listen,
        admin,
        worker_id,
        workers,
        policy_path,
        supervisor_pid,
        signalled,
        startup_errors,
    )


def _die_with_parent(signum: int) -> bool:
    """Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``). It is tied to the thread
    that forked this process, not to the process: the supervisor forks from its main thread,
    which lives as long as it does. False where there is no such call (the watch below
    stops the worker then, within a second)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


async def _watch_parent(supervisor_pid: int, *, stop: bool) -> None:
    """Say so once this worker's parent is no longer the supervisor; with ``stop`` (no
    parent-death signal on this system) stop the worker as SIGTERM does."""
    while True:  # polled: no event says a parent died
        await asyncio.sleep(PARENT_POLL_S)
        if os.getppid() != supervisor_pid:
            break
    log.warning("the supervisor (pid %d) is gone: this worker stops", supervisor_pid)
    if stop:
        os.kill(os.getpid(), signal.SIGTERM)


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
    supervisor_pid = os.getpid()
    startup_errors: multiprocessing.SimpleQueue[str] = ctx.SimpleQueue()

    def start(worker_id: int) -> multiprocessing.process.BaseProcess:
        proc = ctx.Process(
            target=_forked_worker_main,
            args=(
                loaded,
                listen,
                admin,
                worker_id,
                workers,
                policy_path,
                supervisor_pid,
                startup_errors,
            ),
            name=f"gateway-worker-{worker_id}",
        )
        proc.start()
        return proc

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def forward(signum: int, frame: object) -> None:
        # Each worker reloads the policy file on its own SIGHUP, and reopens its access log
        # on its own SIGUSR1 (nginx: both signals to the master).
        for proc in procs.values():
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signum)

    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    shared_dir = None
    if shared_store_selected(loaded.policy.store, workers):
        # The workers' shared limit state starts empty, as in-process state does; the
        # directory stays locked while any of them runs (runtime_dir).
        shared_dir = runtime_dir(supervisor_pid)
        try:
            claim_runtime_dir(shared_dir)
        except SharedDirError as exc:
            sys.stderr.write(f"gateway: {exc}\n")
            return EXIT_STARTUP
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, forward)
    signal.signal(signal.SIGUSR1, forward)
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
        release_runtime_dir(shared_dir)
    if not os.environ.get(ENV_METRICS_DIR):
        # The workers' snapshots; a directory the operator named is theirs to keep.
        shutil.rmtree(supervisor_dir(supervisor_pid), ignore_errors=True)
    said: set[str] = set()
    while not startup_errors.empty():
        message = startup_errors.get()
        if message not in said:
            said.add(message)
            sys.stderr.write(message + "\n")
    sys.stderr.flush()
    return 1 if failed else 0
