"""Limit state shared by the worker processes of one gateway on one machine, exactly.

The states live in an LMDB environment (a memory-mapped B+tree with cross-process write
transactions) under a runtime directory the supervisor cleans at start. A request's checks are
decided in one write transaction: every state is read, the same pure algorithms as the
in-process store decide at one instant, and every new state is written (allowed) or none
(rejected). LMDB serialises write transactions across processes with a robust mutex, so a
worker killed mid-transaction leaves nothing behind: its uncommitted writes are never seen.
A worker of several reads and decides on a snapshot first and takes that mutex only to write,
deciding again under it if another process changed what it read (``_decide_optimistic``).
With ``store.worker_lease`` a worker decides a hot key's requests from batches of its quota
charged in that state (``worker_lease.py``, with each algorithm's bound; ``_decide_leased``).

Three databases:

- ``state``: ``slot | key`` -> ``tick | state``; ``slot`` (4 bytes) names a limit's table,
  ``tick`` (8 bytes, in 100 ms) is the key's last use. The environment's main database,
  beside the two others' records: a commit to a named database also rewrites its record
  there, a write every request would pay. (A state key cannot be one of those names: the
  shortest is ``meta``, which as a key would need slot 0x6d657461.)
- ``lru``: ``slot | tick | key`` -> empty: each table's keys by last use, oldest first. A key
  moves in it at most once per tick, so a hot key costs one put per request.
- ``meta`` (``tables.py`` administers it on a reload): the policy in force (its hash and a
  generation number, so that a reload rescales once whichever worker reloads first), each
  limit's slot, identity and algorithm, each table's key count, evictions and expiries, and
  (``dropped:``) the evictions of tables a reload dropped, by name, so that a limit's
  evictions never go down.
- ``held``: ``slot | worker | key`` -> the slots of a concurrency limit's key this worker's
  requests hold (8 bytes), written in the transaction that takes or gives them back. A worker
  killed with requests in flight leaves its records; the worker the supervisor starts in its
  place (the same worker number) gives those slots back before its first request
  (``_reclaim``), so a dead worker's slots are held until the supervisor notices, not forever.

A concurrency limit's key is forgotten as soon as it holds no slot, so its table counts the
keys holding slots; a new key in a full table reads as holding every slot (refused, as nginx's
``limit_conn`` refuses one when its zone is full): no key holding slots is ever evicted.

Bounded like an nginx zone: a new key first looks at the table's two least recently used
keys and drops those whose state is idle (a fresh key would decide the same: an expiry, as
nginx's ``ngx_http_limit_req_expire``), so a table does not fill with dead keys; in a full
table it then takes the place of the least recently used key, counted as an eviction unless
that key's state was idle. Only new keys pay for the look; a known key's request does not.

States are packed in 16 bytes, ``tick | state`` (a signed 64-bit state), when they fit; any
other state is tagged (``tick | tag | payload``, the tick's top bit set to say so).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import lmdb
from mypy_extensions import mypyc_attr

from gateway.algorithms.base import Decision
from gateway.algorithms.charging import charge_what_fits
from gateway.algorithms.combine import CombinedDecision, combine
from gateway.algorithms.concurrency import Concurrency
from gateway.clock import Clock, MonotonicClock
from gateway.limits.compiled import Check, CompiledLimit, with_variants
from gateway.stores.immediate import DecidesNow
from gateway.stores.protocol import StoreUnavailableError
from gateway.stores.shared.records import (
    HELD,
    MAX_KEY_BYTES,
    TAGGED,
    TICK,
    TICK_STATE,
    decode_state,
    encode_state,
    key_bytes,
)
from gateway.stores.shared.space import (
    DATA_FILE,
    FIRST_MAP_BYTES,
    NoRoom,
    create_map,
    reserve,
    reserved_size,
    size_text,
)
from gateway.stores.shared.tables import (
    COUNTS,
    DROPPED,
    GENERATION,
    POLICY,
    RESETS,
    Databases,
    Table,
    apply_policy,
    forget_key,
    policy_hash,
    read_int,
    read_tables,
    slot_keys,
    table_counts,
)
from gateway.stores.shared.worker_lease import (
    RESET_CHECK_US,
    Lease,
    LeaseTally,
    WorkerLeases,
    bound_text,
)
from gateway.stores.store_stats import StoreStats

# Bytes of map per tracked key: a state entry and an LRU entry with their B+tree overhead,
# for keys up to ``MAX_KEY_BYTES``: the most the map grows to is bounded from the policy. It
# starts smaller and doubles as it fills, each size reserved on the filesystem first (``space``).
MAP_BYTES_PER_KEY: Final = 2048
MAP_BYTES_BASE: Final = 64 << 20
TICK_US: Final = 100_000  # LRU order to 100 ms: a hot key moves in it at most 10 times a second

# Idle keys looked at, least recently used first, each time a new key is added (as nginx).
EXPIRE_ON_INSERT: Final = 2
# The end of the map new keys may not take (a 16th, at least this many bytes): it is kept for
# the copy-on-write pages of known keys' updates, so that they go on when the map cannot grow.
UPDATES_ROOM_BYTES: Final = 1 << 20
# New keys added between two looks at the map's last page (a look costs some microseconds; 32
# keys take a few dozen pages of the room kept, which is at least 256).
INSERTS_PER_ROOM_CHECK: Final = 32
_MAX_STATE_KEY: Final = 4 + MAX_KEY_BYTES


# A state read on a snapshot: its key, the bytes read (None: no state), and the bytes an
# admission writes with one put (None: written by ``_write_moved``).
_Found = tuple[bytes, bytes | None, bytes | None]
# A state whose key is new, moves in the LRU index or is forgotten: key, last tick (None: a
# new key), limit, new state.
_Moved = tuple[bytes, int | None, CompiledLimit, Any]
# A concurrency check's slots an admission takes: its state key, and how many.
_Taken = tuple[bytes, int]


def _merged(
    verdict: CombinedDecision,
    sent: Sequence[int],
    at_hand: Sequence[Lease | None],
    leases: WorkerLeases,
) -> CombinedDecision:
    """The request's verdict from the shared state's on the checks ``sent`` there and the
    units at hand in this worker's batches for the others (taken if it admits)."""
    if len(sent) == len(at_hand):
        return verdict
    decisions: list[Decision] = []
    states: list[Any] = []
    position = 0
    for lease in at_hand:
        if lease is None:
            decisions.append(verdict.decisions[position])
            states.append(verdict.states[position])
            position += 1
        else:
            decisions.append(leases.take(lease) if verdict.allowed else leases.peek(lease))
            states.append(None)
    delayed_by = verdict.delayed_by
    return CombinedDecision(
        verdict.allowed,
        verdict.delay_s,
        verdict.retry_after_s,
        tuple(sent[j] for j in verdict.rejected_by),
        None if delayed_by is None else sent[delayed_by],
        tuple(decisions),
        tuple(states),
        verdict.now_us,
    )


class _MapNearlyFull(Exception):
    """A new key would take the room kept for updates: the map must grow first."""


# Interpreted subclasses allowed: a test makes another worker's commit happen between a
# snapshot and its write by overriding ``_read_and_decide``.
@mypyc_attr(allow_interpreted_subclasses=True)
class SharedStore(DecidesNow):
    """State shared by a gateway's workers in one LMDB environment (see the module)."""

    name = "shared"
    verdicts_on_clock = True
    decides_penalties = False  # the workers' boxes: stores.shared.penalties

    def __init__(
        self,
        path: Path | None,
        clock: Clock | None = None,
        *,
        reports_counts: bool = True,
        workers: int = 1,
        on_failure: str = "local",
        worker_id: int = 0,
        lease_units: int = 0,
        lease_interval_s: float = 0.0,
    ) -> None:
        # ``path`` None: build and validate only (``gateway check``), nothing opened.
        self.path = path
        # A decision that needs room the filesystem cannot give: ``deny`` answers 503, the
        # others decide on the state as it is, without writing (``_decide_without_room``).
        self._on_failure = on_failure
        self._map_bound = MAP_BYTES_BASE
        self._insert_pages = 0  # new keys are added while the last page is below this
        self._unchecked_inserts = INSERTS_PER_ROOM_CHECK  # the first new key looks
        self.clock: Clock = clock or MonotonicClock()
        self.stats = StoreStats()
        # Tracked keys and evictions are the shared tables': one worker reports them, so
        # that the metrics summed over workers count each once.
        self.reports_counts = reports_counts
        # Several processes write: decide outside the writers' lock (``_decide_optimistic``).
        self._optimistic = workers > 1
        # Decisions made again under the writers' lock: another worker committed a state this
        # one had read between its snapshot and its write (contention on hot keys).
        self.redecided = 0
        # ``store.worker_lease``: hot keys decided from batches of their quota (``worker_lease``).
        self.workers = workers
        self.leases: WorkerLeases | None = None
        if lease_units > 1:
            self.leases = WorkerLeases(lease_units, max(round(lease_interval_s * 1e6), 1), workers)
        # Other workers take and give back slots too: a request waiting for one looks again.
        self.slots_shared = workers > 1
        # This worker's number in the ``held`` records: the same in the worker started in
        # its place, which gives back what they hold (``_reclaim``, once).
        self._worker = HELD.pack(worker_id)
        self._reclaimed = False
        self._env: lmdb.Environment | None = None
        self._state: Any = None
        self._lru: Any = None
        self._meta: Any = None
        self._held: Any = None
        self._dbs = Databases(None, None, None, None)
        self._generation: bytes | None = b"unread"
        # The last committed transaction at which ``_generation`` was read or known current
        # (-1: none): a transaction that starts from it needs no read of the generation.
        self._current_at = -1
        # Keys reset through the keys' API (by any worker), as this worker last read the count,
        # and when: a change drops its batches (``_check_resets``).
        self._resets = 0
        self._resets_read_us = 0
        self._tables: dict[str, Table] = {}
        # Table name -> (the limit last seen under it, its table or None, the table's key
        # prefix or None): the request path's look-up (see ``_table_of``).
        self._by_limit: dict[str, tuple[CompiledLimit, Table | None, bytes | None]] = {}
        self._limits: Sequence[CompiledLimit] = ()

    # -- opening and reloads -------------------------------------------------------------

    def _open(self) -> lmdb.Environment:
        env = self._env
        if env is None:
            assert self.path is not None
            self.path.mkdir(parents=True, exist_ok=True)
            data = self.path / DATA_FILE
            try:
                if reserved_size(data) == 0:  # not made by ``claim_runtime_dir``
                    create_map(self.path)
                # Every process maps the data file's size, all of it allocated: a smaller map
                # would make LMDB truncate the file under the others' maps.
                size = reserve(data, max(reserved_size(data), FIRST_MAP_BYTES))
            except NoRoom as exc:
                raise ValueError(str(exc)) from None
            env = lmdb.open(
                str(self.path),
                map_size=size,
                max_dbs=4,
                sync=False,  # state starts empty at every start: nothing to make durable
                metasync=False,
                writemap=True,
                readahead=False,
                meminit=False,
                max_readers=256,
            )
            self._state = env.open_db(None)  # the main database (see the module)
            self._lru = env.open_db(b"lru")
            self._meta = env.open_db(b"meta")
            self._held = env.open_db(b"held")
            self._dbs = Databases(self._state, self._lru, self._meta, self._held)
            self._env = env
            self._mapped(env)
        return env

    def _mapped(self, env: lmdb.Environment) -> None:
        """The map changed size: where new keys stop (``UPDATES_ROOM_BYTES``)."""
        page = int(env.stat()["psize"])
        pages = int(env.info()["map_size"]) // page
        self._insert_pages = pages - max(UPDATES_ROOM_BYTES // page, pages // 16)

    def _grow(self, env: lmdb.Environment) -> str | None:
        """Map more of the data file: as much as another worker reserved, else the next size
        (twice the map, at most the policy's bound), reserved first. None once grown; else
        why not (the store's state is then ``fallback``, logged with the reason once)."""
        assert self.path is not None
        data = self.path / DATA_FILE
        mapped = int(env.info()["map_size"])
        size = reserved_size(data)
        if size <= mapped:
            target = min(mapped * 2, self._map_bound)
            if target <= mapped:
                return self._no_room(f"{self.path}: the map is at its bound ({size_text(mapped)})")
            try:
                size = reserve(data, target)
            except NoRoom as exc:
                return self._no_room(str(exc))
        env.set_mapsize(size)
        self._mapped(env)
        self.stats.set_state("ok")
        return None

    def _no_room(self, reason: str) -> str:
        if self._on_failure == "deny":
            then = "requests that need more room get 503 (store.on_failure: deny)"
        else:
            then = "requests that need more room are decided on the state as it is, not counted"
        self.stats.set_state("fallback", f"{reason}; {then}")
        return reason

    def _adopt_map(self, env: lmdb.Environment) -> None:
        """Another worker grew the map: map the data file's size, which it reserved first
        (never LMDB's ``set_mapsize(0)``: the size it records may be larger than this process
        knows is reserved, or smaller, and mapping less truncates the file under the others)."""
        assert self.path is not None
        env.set_mapsize(max(reserved_size(self.path / DATA_FILE), int(env.info()["map_size"])))
        self._mapped(env)

    def configure(self, limits: Sequence[CompiledLimit], previous: Sequence[CompiledLimit]) -> None:
        """Adopt a policy's limits. The first worker to adopt a policy keeps, rescales or frees
        each table's state (the environment records the algorithms it was made under, so
        ``previous`` is not needed); the others find it done by its hash. Overrides' variants
        have tables of their own."""
        limits = tuple(with_variants(limits))
        for limit in limits:
            probe = limit.algorithm.decide(None, 0)[1]
            if probe is not None and not isinstance(probe, int | bytes):
                raise ValueError(f"the shared store cannot hold {limit.spec.algorithm} states")
        self._limits = tuple(limits)
        if self.leases is not None:
            self.leases.clear()
        if self.path is None:
            return
        self._map_bound = max(
            MAP_BYTES_BASE + MAP_BYTES_PER_KEY * sum(lim.spec.max_keys for lim in limits),
            self._map_bound,
        )
        env = self._open()
        wanted = policy_hash(limits)
        now_us = self.clock.now_us()
        unix_us = self.clock.unix_us()
        while True:
            try:
                with self._begin(env, True) as txn:
                    if txn.get(POLICY, db=self._meta) != wanted:
                        apply_policy(txn, self._dbs, limits, now_us, unix_us)
                        txn.put(POLICY, wanted, db=self._meta)
                        generation = read_int(txn, self._dbs, GENERATION) + 1
                        txn.put(GENERATION, TICK.pack(generation), db=self._meta)
                    self._load_tables(txn)
                    self._resets = read_int(txn, self._dbs, RESETS)
                    self._resets_read_us = now_us
                    if not self._reclaimed:
                        self._reclaim(txn)
                self._reclaimed = True
                return
            except (lmdb.MapFullError, _MapNearlyFull):
                reason = self._grow(env)
                if reason is not None:
                    raise ValueError(reason) from None

    def _reclaim(self, txn: Any) -> None:
        """Give back the slots a worker of this number held when it died (its ``held``
        records): before this worker's first request, so its own records start empty."""
        worker = self._worker
        for table in self._tables.values():
            for record, raw in slot_keys(txn, self._held, table.prefix + worker):
                key = table.prefix + record[6:]
                self._give_back(txn, table, key, TICK.unpack(raw)[0], self.clock.now_us())
                txn.delete(record, db=self._held)

    def _give_back(self, txn: Any, table: Table, key: bytes, cost: int, now_us: int) -> None:
        """``cost`` slots of ``key`` back in its state (not below none); a key that holds
        none is forgotten."""
        raw = txn.get(key, db=self._state)
        if raw is None:
            return
        tick, held = decode_state(raw)
        held = table.algorithm.refund(held, now_us, cost)
        if held > 0:
            txn.put(key, encode_state(tick, held), db=self._state)
        else:
            forget_key(txn, self._dbs, table.slot, key, tick)

    def _load_tables(self, txn: Any) -> None:
        self._tables = read_tables(txn, self._dbs)
        self._by_limit = {}
        raw = txn.get(GENERATION, db=self._meta)
        self._generation = None if raw is None else bytes(raw)
        self._current_at = -1

    def _table_of(self, limit: CompiledLimit) -> Table | None:
        """The table holding ``limit``'s states, or None: a table another worker's newer
        policy made for other keys or another algorithm is not this limit's (its requests are
        decided afresh and stored nowhere until this worker adopts that policy too).
        Remembered for the last limit object seen under each table name until the tables
        change (the request path compares the object, not its identity tuple)."""
        entry = self._by_limit.get(limit.table)
        if entry is not None and entry[0] is limit:
            return entry[1]
        table = self._tables.get(limit.table)
        if table is not None and table.identity != limit.identity:
            table = None
        self._by_limit[limit.table] = (limit, table, None if table is None else table.prefix)
        return table

    def _refresh(self, txn: Any) -> None:
        """Another worker adopted a policy: read the tables it left."""
        if txn.get(GENERATION, db=self._meta) != self._generation:
            self._load_tables(txn)

    # -- the request path ------------------------------------------------------------------

    def _env_for_requests(self) -> lmdb.Environment:
        env = self._env
        if env is None:
            raise RuntimeError("the shared store has no runtime directory (configure first)")
        return env

    def _begin(self, env: lmdb.Environment, write: bool, db: Any = None) -> Any:
        # Positional arguments: py-lmdb parses keywords on every call.
        try:
            return env.begin(db, None, write)
        except lmdb.MapResizedError:
            self._adopt_map(env)  # another worker grew the map
            return env.begin(db, None, write)

    async def decide(self, checks: Sequence[Check], *, commit: bool = True) -> CombinedDecision:
        return self.decide_now(checks, commit=commit)

    def decide_now(self, checks: Sequence[Check], *, commit: bool = True) -> CombinedDecision:
        """``decide`` without the coroutine: an LMDB transaction never waits on the loop, so
        the engine calls this directly on the request path, as for the in-process store."""
        now_us = self.clock.now_us()
        self.stats.calls += 1
        env = self._env
        if env is None:
            raise RuntimeError("the shared store has no runtime directory (configure first)")
        try:
            if commit:
                if self.leases is not None:
                    return self._decide_leased(env, self.leases, checks, now_us)
                if self._optimistic:
                    return self._decide_optimistic(env, checks, now_us)
            return self._decide_in_one(env, checks, commit, now_us)
        except (lmdb.MapFullError, _MapNearlyFull):
            return self._decide_after_growing(env, checks, commit, now_us)

    def _decide_leased(
        self, env: lmdb.Environment, leases: WorkerLeases, checks: Sequence[Check], now_us: int
    ) -> CombinedDecision:
        """``store.worker_lease``: a request whose every check has a unit in this worker's
        batches is decided from them, without the shared state. Else the checks without one
        are decided there in one transaction, a leased key met again lately charged a new
        batch (``worker_lease``), and the others take their unit from their batch if the
        request is admitted. A batch the state refuses is not asked again until the key's
        lease expires: the request is decided again with each check charged its cost."""
        if now_us - self._resets_read_us >= RESET_CHECK_US:
            self._check_resets(env, leases, now_us)
        taken = leases.take_all(checks, now_us)
        if taken is not None:
            return CombinedDecision(True, 0.0, 0.0, (), None, tuple(taken), (None,) * len(taken))
        at_hand: list[Lease | None] = []
        sent: list[int] = []
        asked: list[Check] = []
        batches: list[int] = []
        for index, check in enumerate(checks):
            lease = leases.at_hand(check, now_us)
            at_hand.append(lease)
            if lease is not None:
                continue
            batch = leases.batch_for(check, now_us)
            sent.append(index)
            batches.append(batch)
            if batch == check.cost:
                asked.append(check)
            else:
                asked.append(
                    Check(check.limit, check.key, check.max_delay_s, check.reserved, batch)
                )
        verdict = self._decide_writing(env, asked, now_us)
        refused = [j for j in verdict.rejected_by if asked[j] is not checks[sent[j]]]
        if refused:
            for j in refused:
                leases.refused_batch(checks[sent[j]], now_us)
            asked = [checks[index] for index in sent]
            batches = [check.cost for check in asked]
            verdict = self._decide_writing(env, asked, now_us)
        if verdict.allowed:
            for j, index in enumerate(sent):
                if asked[j] is not checks[index]:
                    leases.granted_batch(checks[index], batches[j], verdict.decisions[j], now_us)
        return _merged(verdict, sent, at_hand, leases)

    def _check_resets(self, env: lmdb.Environment, leases: WorkerLeases, now_us: int) -> None:
        """A key reset through the keys' API since this worker last looked (by any worker):
        its batches are dropped (under-admitting, never over), and the keys decided on their
        fresh state; one read transaction every ``RESET_CHECK_US``."""
        self._resets_read_us = now_us
        with self._begin(env, False) as txn:
            resets = read_int(txn, self._dbs, RESETS)
        if resets != self._resets:
            self._resets = resets
            leases.clear()

    def lease_counters(self, limit_name: str) -> LeaseTally | None:
        """What ``store.worker_lease`` did for a limit in this worker (the metrics' lease
        figures); None when it leases nothing of it."""
        leases = self.leases
        return None if leases is None else leases.tally(limit_name)

    def lease_bound(self, limit: CompiledLimit) -> str | None:
        """What ``store.worker_lease`` allows ``limit`` beyond its exact decisions (for
        ``/explain``); None when it is decided exactly."""
        leases = self.leases
        if leases is None:
            return None
        return bound_text(limit, leases.units, leases.interval_us / 1e6, leases.workers)

    def _decide_writing(
        self, env: lmdb.Environment, checks: Sequence[Check], now_us: int
    ) -> CombinedDecision:
        """Decide and commit ``checks`` as without leases (a worker's, or a lone process's)."""
        if self._optimistic:
            return self._decide_optimistic(env, checks, now_us)
        return self._decide_in_one(env, checks, True, now_us)

    def _decide_after_growing(
        self, env: lmdb.Environment, checks: Sequence[Check], commit: bool, now_us: int
    ) -> CombinedDecision:
        """The map is full (nothing was committed): grow it and decide again; without room
        on the filesystem, decide without writing. A full disk never reaches a page LMDB
        writes through the map (that would be SIGBUS), only this."""
        if self._grow(env) is None:
            try:
                return self._decide(checks, commit, now_us)
            except (lmdb.MapFullError, _MapNearlyFull):
                pass
        self.stats.error()
        if self._on_failure == "deny":
            raise StoreUnavailableError("the shared limit state has no room", 1.0)
        return self._decide_in_one(env, checks, False, now_us)

    def _decide(self, checks: Sequence[Check], commit: bool, now_us: int) -> CombinedDecision:
        """``decide_now`` at ``now_us``, without its count and its retry."""
        env = self._env_for_requests()
        if commit and self._optimistic:
            return self._decide_optimistic(env, checks, now_us)
        return self._decide_in_one(env, checks, commit, now_us)

    def _decide_in_one(
        self, env: lmdb.Environment, checks: Sequence[Check], commit: bool, now_us: int
    ) -> CombinedDecision:
        """Read, decide and (``commit``, admitted) write in one transaction: a lone
        process's decision, and a dry run's."""
        try:
            txn = env.begin(self._state, None, commit)
        except lmdb.MapResizedError:
            txn = self._begin(env, commit, self._state)
        try:
            verdict = self._read_and_decide(txn, checks, now_us, commit)[0]
            if commit and verdict.allowed:
                committed = self._current_at + 1  # ``txn``'s own id (see ``_read_and_decide``)
                txn.commit()
                self._current_at = committed  # a request's commit leaves the policy as it was
            else:
                txn.abort()  # and with it the states written for the limits that admitted
        except BaseException:
            txn.abort()
            raise
        return verdict

    def _decide_optimistic(
        self, env: lmdb.Environment, checks: Sequence[Check], now_us: int
    ) -> CombinedDecision:
        """Decide on a snapshot (a read transaction: no lock), then write in a write
        transaction that holds the writers' lock only for the writes. If another process
        committed in between (the write transaction's id is not the snapshot's next), the
        states are read again and, if any differs, decided again under the lock: the
        verdict is always one on the states it is written over. A rejection writes nothing
        and stands on its snapshot.

        Why: the lock is held for a fraction of the decision, so a worker preempted while
        holding it (workers share cores with everything else) blocks the others far less
        often."""
        try:
            snapshot = env.begin(self._state, None, False)
        except lmdb.MapResizedError:
            snapshot = self._begin(env, False, self._state)
        try:
            verdict, found, moved, taken = self._read_and_decide(snapshot, checks, now_us, False)
            seen = snapshot.id()
        finally:
            snapshot.abort()
        if not verdict.allowed:  # rejected: nothing to write
            return verdict
        try:
            txn = env.begin(self._state, None, True)
        except lmdb.MapResizedError:
            txn = self._begin(env, True, self._state)
        try:
            committed = txn.id()
            if committed != seen + 1 and self._changed_since(txn, found):
                self.redecided += 1
                verdict = self._read_and_decide(txn, checks, now_us, True)[0]
                if not verdict.allowed:
                    txn.abort()
                    return verdict
            else:
                put = txn.put
                for key, _, value in found:
                    if value is not None:
                        put(key, value)
                if moved is not None:
                    self._write_moved_states(txn, moved, now_us)
                if taken is not None:
                    self._hold(txn, taken)
            txn.commit()
            self._current_at = committed
        except BaseException:
            txn.abort()
            raise
        return verdict

    def _changed_since(self, txn: Any, found: Sequence[_Found]) -> bool:
        """Whether the policy or any state read (``found``) is not what ``txn`` holds."""
        get = txn.get
        if get(GENERATION, None, self._meta) != self._generation:
            return True
        return any(get(key) != raw for key, raw, _ in found)

    def _read_and_decide(
        self, txn: Any, checks: Sequence[Check], now_us: int, write: bool
    ) -> tuple[CombinedDecision, list[_Found], list[_Moved] | None, list[_Taken] | None]:
        """Read the states in ``txn`` and decide. With ``write`` (a write transaction the
        caller commits only for an admission) each limit's new state is written as soon as
        it is decided, and new and moved keys and this worker's slots once all admit;
        without, what was read and what an admission writes are returned."""
        # The request path: each check's state read, states packed in 16 bytes. The state
        # database is the transaction's default and every py-lmdb call takes positional
        # arguments (keywords cost the binding a parse per call). The generation is read
        # only when another transaction committed since it was last known current.
        # ``_current_at`` is ``base`` on return (a lone process's commit reads it).
        base = txn.id() - write  # the committed transaction ``txn`` starts from
        if base != self._current_at:
            if txn.get(GENERATION, None, self._meta) != self._generation:
                self._load_tables(txn)  # another worker adopted a policy
            self._current_at = base
        by_limit = self._by_limit
        get = txn.get
        put = txn.put if write else None
        unpack = TICK_STATE.unpack
        pack = TICK_STATE.pack
        now_tick = now_us // TICK_US
        unix_us = 0  # calendar time, read when a calendar window needs it
        found: list[_Found] = []
        moved: list[_Moved] | None = None
        taken: list[_Taken] | None = None
        states: list[Any] = []
        decisions: list[Decision] = []
        new_states: list[Any] = []
        # Declared: compiled, a name takes the type of its first assignment (a slot count).
        state: Any
        for check in checks:
            limit = check.limit
            entry = by_limit.get(limit.table)
            if entry is None or entry[0] is not limit:
                self._table_of(limit)
                entry = by_limit[limit.table]
            prefix = entry[2]
            at_us = now_us
            if limit.calendar:
                if not unix_us:
                    unix_us = self.clock.unix_us()
                at_us = unix_us
            if prefix is None:
                state = None
                decision, new_state = limit.decides.decide(None, at_us, check.cost)
            elif limit.admits_free:
                # Charged after the response (``charge``): decided, nothing written now.
                key = prefix + key_bytes(check.key)
                raw = get(key)
                state = None if raw is None else decode_state(raw)[1]
                decision, _ = limit.decides.decide(state, at_us, check.cost)
                new_state = state
                if put is None:
                    found.append((key, raw, None))
            else:
                try:
                    key = prefix + check.key.encode()
                except UnicodeEncodeError:  # a lone surrogate (``key_bytes`` keeps it)
                    key = prefix + key_bytes(check.key)
                if len(key) > _MAX_STATE_KEY:
                    key = prefix + key_bytes(check.key)
                raw = get(key)
                if raw is None:
                    tick = state = None
                    if limit.holds_slots:
                        state = self._full_as_held(txn, entry[1], limit)
                else:
                    try:
                        tick, state = unpack(raw)
                    except struct.error:  # not 16 bytes: tagged
                        tick = TAGGED
                    if tick >= TAGGED:
                        tick, state = decode_state(raw)
                decision, new_state = limit.decides.decide(state, at_us, check.cost)
                if limit.holds_slots:
                    if taken is None:
                        taken = [(key, check.cost)]
                    else:
                        taken.append((key, check.cost))
                if tick == now_tick and new_state is not None:  # a known key, this LRU tick
                    try:
                        value: bytes | None = pack(now_tick, new_state)
                    except struct.error:  # a state that does not fit 64 bits
                        value = encode_state(now_tick, new_state)
                    if put is not None:
                        put(key, value)
                else:  # a new, moved or forgotten key
                    value = None
                    if moved is None:
                        moved = [(key, tick, limit, new_state)]
                    else:
                        moved.append((key, tick, limit, new_state))
                if put is None:
                    found.append((key, raw, value))
            states.append(state)
            decisions.append(decision)
            new_states.append(new_state)
        verdict = combine(
            decisions, new_states, states, now_us, [check.max_delay_s for check in checks]
        )
        if put is not None and verdict.allowed:
            if moved is not None:
                self._write_moved_states(txn, moved, now_us)
            if taken is not None:
                self._hold(txn, taken)
        return verdict, found, moved, taken

    def _full_as_held(self, txn: Any, table: Table | None, limit: CompiledLimit) -> int | None:
        """A concurrency limit's new key: no state, or, in a table as full as ``max_keys``
        (every key there holds slots), every slot held, so that the algorithm refuses it."""
        if table is None:
            return None
        if table_counts(txn, self._dbs, table.slot)[0] < table.max_keys:
            return None
        algorithm = limit.algorithm
        assert isinstance(algorithm, Concurrency)
        return algorithm.limit

    def _hold(self, txn: Any, taken: Sequence[_Taken]) -> None:
        """Record the slots this worker's admitted request took (``held``)."""
        held_db = self._held
        worker = self._worker
        for key, cost in taken:
            record = key[:4] + worker + key[4:]
            raw = txn.get(record, None, held_db)
            count = cost if raw is None else TICK.unpack(raw)[0] + cost
            txn.put(record, TICK.pack(count), True, True, False, held_db)

    def charge_now(self, checks: Sequence[Check], units: Sequence[int]) -> list[int]:
        """Charge each check ``units`` after its response, as much as its key has room for, in
        one write transaction; what each took. A full map takes nothing (the lenient side, as
        a decision without room is)."""
        env = self._env_for_requests()
        try:
            return self._charge(env, checks, units)
        except (lmdb.MapFullError, _MapNearlyFull):
            if self._grow(env) is None:
                try:
                    return self._charge(env, checks, units)
                except (lmdb.MapFullError, _MapNearlyFull):
                    pass
            self.stats.error()
            for check in checks:
                check.limit.counters.charge_failures += 1
            return [0] * len(checks)

    async def charge(self, checks: Sequence[Check], units: Sequence[int]) -> list[int]:
        return self.charge_now(checks, units)

    def _charge(
        self, env: lmdb.Environment, checks: Sequence[Check], units: Sequence[int]
    ) -> list[int]:
        clock = self.clock
        now_us = clock.now_us()
        now_tick = now_us // TICK_US
        taken: list[int] = []
        txn = self._begin(env, True, self._state)
        try:
            self._refresh(txn)
            for check, cost in zip(checks, units, strict=True):
                limit = check.limit
                table = self._table_of(limit)
                if table is None:
                    taken.append(0)
                    continue
                key = table.prefix + key_bytes(check.key)
                raw = txn.get(key)
                tick, state = (None, None) if raw is None else decode_state(raw)
                at_us = clock.unix_us() if limit.calendar else now_us
                # The table's algorithm: a reload since the admission may have rescaled it.
                charged, new_state = charge_what_fits(table.algorithm, state, at_us, cost)
                if charged:
                    self._write_moved(txn, limit, key, tick, new_state, now_us, now_tick)
                taken.append(charged)
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        return taken

    def _write_moved_states(self, txn: Any, moved: Sequence[_Moved], now_us: int) -> None:
        now_tick = now_us // TICK_US
        for key, tick, limit, state in moved:
            self._write_moved(txn, limit, key, tick, state, now_us, now_tick)

    def _write_moved(
        self,
        txn: Any,
        limit: CompiledLimit,
        key: bytes,
        tick: int | None,
        state: Any,
        now_us: int,
        now_tick: int,
    ) -> None:
        """Write a state whose key is new, was last used in another LRU tick (it moves in the
        LRU index), or is forgotten (``state`` None)."""
        table = self._table_of(limit)
        assert table is not None  # ``key`` was made from it in this transaction
        if state is None:
            if tick is not None:
                forget_key(txn, self._dbs, table.slot, key, tick)
            return
        if tick is None:
            # Its table's idle keys expire by the table's clock: calendar time for a calendar
            # window (the LRU ticks stay on the store's clock).
            at_us = self.clock.unix_us() if limit.calendar else now_us
            self._insert(txn, table, key, at_us, now_tick)
        else:
            lru = self._lru
            txn.delete(key[:4] + TICK.pack(tick) + key[4:], b"", lru)
            txn.put(key[:4] + TICK.pack(now_tick) + key[4:], b"", True, True, False, lru)
        txn.put(key, encode_state(now_tick, state), True, True, False, self._state)

    def _insert(self, txn: Any, table: Table, key: bytes, now_us: int, now_tick: int) -> None:
        """Count a new key. First the table's least recently used keys are looked at: up to
        ``EXPIRE_ON_INSERT`` idle ones not used in this tick or the one before are dropped
        (expiries), and in a full table as many as make room (evictions, unless idle).

        Keys used that lately are left alone: a busy key whose state drains within the
        interval between its requests (a high rate) would otherwise be dropped and counted
        in again on every request, paying for both."""
        self._unchecked_inserts += 1
        if self._unchecked_inserts >= INSERTS_PER_ROOM_CHECK:
            env = self._env
            if env is not None and env.info()["last_pgno"] >= self._insert_pages:
                raise _MapNearlyFull  # and the next new key looks again
            self._unchecked_inserts = 0
        prefix = table.prefix
        recent = TICK.pack(max(now_tick - 1, 0))  # LRU ticks are big-endian: bytes compare
        state_db = self._state
        count, evictions, expiries = table_counts(txn, self._dbs, table.slot)
        is_idle = table.algorithm.is_idle
        looked = 0
        with txn.cursor(self._lru) as cursor:
            found = cursor.set_range(prefix)
            while found:
                oldest = cursor.key()
                if not oldest.startswith(prefix):
                    break
                full = count >= table.max_keys
                if not full and (looked >= EXPIRE_ON_INSERT or oldest[4:12] >= recent):
                    break
                state_key = prefix + oldest[12:]
                raw = txn.get(state_key, None, state_db)
                idle = raw is None or is_idle(decode_state(raw)[1], now_us)
                if not (idle or full):
                    break
                looked += 1
                if idle:
                    expiries += 1
                else:
                    evictions += 1
                txn.delete(state_key, b"", state_db)
                found = cursor.delete()  # and on to the next oldest
                count -= 1
        txn.put(b"counts:" + prefix, COUNTS.pack(count + 1, evictions, expiries),
                True, True, False, self._meta)  # fmt: skip
        txn.put(prefix + TICK.pack(now_tick) + key[4:], b"", True, True, False, self._lru)

    def try_decide_now(self, checks: Sequence[Check]) -> CombinedDecision:
        return self.decide_now(checks)

    async def decide_each(self, checks: Sequence[Check]) -> list[CombinedDecision]:
        return [await self.decide((check,)) for check in checks]

    def release(self, checks: Sequence[Check]) -> None:
        """Give back the slots of an admitted request's concurrency checks, in its state and
        this worker's ``held`` record (no more than that record holds: a slot taken while the
        map had no room was never written). Never raises: the failure is counted, and the
        slots stay held until this worker is restarted."""
        env = self._env
        if env is None:
            return
        try:
            try:
                self._release(env, checks)
            except (lmdb.MapFullError, _MapNearlyFull):
                if self._grow(env) is None:
                    self._release(env, checks)
        except lmdb.Error:
            self.stats.error()

    def _release(self, env: lmdb.Environment, checks: Sequence[Check]) -> None:
        now_us = self.clock.now_us()
        held_db = self._held
        worker = self._worker
        with self._begin(env, True) as txn:
            self._refresh(txn)
            for check in checks:
                table = self._tables.get(check.limit.table)
                if table is None or not isinstance(table.algorithm, Concurrency):
                    continue  # a reload removed the limit, or made it another: nothing held
                key = table.prefix + key_bytes(check.key)
                record = key[:4] + worker + key[4:]
                raw = txn.get(record, None, held_db)
                if raw is None:
                    continue
                mine = TICK.unpack(raw)[0]
                cost = min(check.cost, mine)
                if mine > cost:
                    txn.put(record, TICK.pack(mine - cost), True, True, False, held_db)
                else:
                    txn.delete(record, b"", held_db)
                self._give_back(txn, table, key, cost, now_us)
            self._current_at = -1  # this commit: read the generation again next time

    async def refund(self, checks: Sequence[Check], charged_us: int | None = None) -> None:
        self.refund_now(checks, charged_us)

    def refund_now(self, checks: Sequence[Check], charged_us: int | None = None) -> None:
        """``refund``, done rather than awaited (one write transaction)."""
        env = self._env_for_requests()
        try:
            self._refund(env, checks, charged_us)
        except (lmdb.MapFullError, _MapNearlyFull):
            if self._grow(env) is None:  # else the charge stays: the strict side
                self._refund(env, checks, charged_us)

    def _refund(
        self, env: lmdb.Environment, checks: Sequence[Check], charged_us: int | None
    ) -> None:
        now_us = self.clock.now_us()
        unix_us = self.clock.unix_us()
        with self._begin(env, True) as txn:
            self._refresh(txn)
            for check in checks:
                table = self._tables.get(check.limit.table)
                # A reload may have removed the limit, or given its name another algorithm
                # whose states this request's charge is no part of: nothing to give back then.
                if table is None or type(table.algorithm) is not type(check.limit.algorithm):
                    continue
                if check.limit.holds_slots:  # given back by ``release``
                    continue
                key = table.prefix + key_bytes(check.key)
                raw = txn.get(key, db=self._state)
                if raw is None:
                    continue
                tick, state = decode_state(raw)
                at_us, charged_at_us = now_us, charged_us
                if check.limit.calendar:  # on calendar time; the verdict's instant is not
                    at_us = unix_us
                    if charged_us is not None:
                        charged_at_us = charged_us + unix_us - now_us
                # The table's algorithm: rescaled by a reload that changed its parameters.
                state = table.algorithm.refund(state, at_us, check.cost, charged_us=charged_at_us)
                txn.put(key, encode_state(tick, state), db=self._state)

    # -- what the metrics read ---------------------------------------------------------------

    def _limit_counts(self, limit_name: str) -> tuple[int, int]:
        """A limit's tracked keys and evictions over its tables (its own and its overrides'
        variants, ``name~N``, as the in-process store counts them), the evictions of tables a
        reload dropped included."""
        env = self._env
        if env is None or not self.reports_counts:
            return (0, 0)
        variant = limit_name + "~"
        slots = [
            table.slot
            for name, table in self._tables.items()
            if name == limit_name or name.startswith(variant)
        ]
        keys = evictions = 0
        with self._begin(env, False) as txn:
            for slot in slots:
                count, evicted, _ = table_counts(txn, self._dbs, slot)
                keys += count
                evictions += evicted
            with txn.cursor(self._meta) as cursor:
                found = cursor.set_range(DROPPED + limit_name.encode())
                while found:
                    name = bytes(cursor.key())
                    if not name.startswith(DROPPED + limit_name.encode()):
                        break
                    table_name = name[len(DROPPED) :].decode()
                    if table_name == limit_name or table_name.startswith(variant):
                        evictions += TICK.unpack(cursor.value())[0]
                    found = cursor.next()
        return keys, evictions

    def _counts_of(self, table_name: str) -> tuple[int, int, int]:
        """One table's keys, evictions and expiries (for inspection)."""
        table = self._tables[table_name]
        with self._begin(self._env_for_requests(), False) as txn:
            return table_counts(txn, self._dbs, table.slot)

    def tracked_keys(self, limit_name: str) -> int:
        return self._limit_counts(limit_name)[0]

    def slots_in_use(self, table_name: str) -> int:
        """The slots held under a concurrency limit's table, by every worker (inspection: it
        reads every key)."""
        table = self._tables[table_name]
        with self._begin(self._env_for_requests(), False) as txn:
            return sum(decode_state(raw)[1] for _, raw in slot_keys(txn, self._state, table.prefix))

    def evictions(self, limit_name: str) -> int:
        return self._limit_counts(limit_name)[1]

    # -- the keys' API (``stores.key_listing.SharedKeys``): every worker's keys --

    def keys_held(self, limit: CompiledLimit, most: int) -> list[str]:
        """Up to ``most`` keys ``limit``'s table holds (not those stored by a digest: a key
        longer than ``MAX_KEY_BYTES``)."""
        env = self._env
        table = self._table_of(limit) if env is not None else None
        if env is None or table is None:
            return []
        prefix = table.prefix
        keys: list[str] = []
        with self._begin(env, False) as txn, txn.cursor(self._state) as cursor:
            found = cursor.set_range(prefix)
            while found and len(keys) < most:
                key = bytes(cursor.key())
                if not key.startswith(prefix):
                    break
                if key[4:5] != b"#":
                    keys.append(key[4:].decode("utf-8", "surrogatepass"))
                found = cursor.next()
        return keys

    def holds(self, limit: CompiledLimit, key: str) -> bool:
        env = self._env
        table = self._table_of(limit) if env is not None else None
        if env is None or table is None:
            return False
        with self._begin(env, False) as txn:
            return txn.get(table.prefix + key_bytes(key), None, self._state) is not None

    def forget(self, limit: CompiledLimit, key: str) -> bool:
        """Drop ``key``'s state for every worker. The workers' batches (``worker_lease``) go
        too: the count of resets is raised, which each worker reads every ``RESET_CHECK_US``
        of its requests (this one drops its own at once)."""
        env = self._env
        table = self._table_of(limit) if env is not None else None
        if env is None or table is None:
            return False
        state_key = table.prefix + key_bytes(key)
        with self._begin(env, True) as txn:
            if self.leases is not None:
                resets = read_int(txn, self._dbs, RESETS) + 1
                txn.put(RESETS, TICK.pack(resets), db=self._meta)
                self._resets = resets
                self.leases.clear()
            raw = txn.get(state_key, None, self._state)
            if raw is None:
                return False
            forget_key(txn, self._dbs, table.slot, state_key, decode_state(raw)[0])
        return True

    async def prepare(self) -> None:
        """Opened by ``configure``: nothing more to get ready."""

    async def close(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            env.close()
