"""The shared store's tables, as a reload administers them: each limit's table kept, rescaled,
shrunk or freed when a policy is adopted, and the records in ``meta`` that describe them (the
policy's hash, the generation, each table's slot, identity, algorithm and counts). The request
path, which reads these records and moves keys, is in ``lmdb_store.py``."""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

from gateway.limits.compiled import CompiledLimit
from gateway.stores.shared.records import TICK, decode_state, encode_state

SLOT: Final = struct.Struct(">I")
COUNTS: Final = struct.Struct("<qqq")  # keys, evictions, expiries
POLICY: Final = b"policy"
GENERATION: Final = b"generation"
NEXT_SLOT: Final = b"next_slot"
RESETS: Final = b"resets"  # keys reset through the keys' API: the workers drop their batches
DROPPED: Final = b"dropped:"  # table name -> evictions of its tables reloads dropped


class Databases(NamedTuple):
    """The environment's four databases (see ``lmdb_store``)."""

    state: Any
    lru: Any
    meta: Any
    held: Any


class Table(NamedTuple):
    """A limit's record in ``meta``."""

    slot: int
    identity: tuple[str, tuple[str, ...], str]
    algorithm: Any
    max_keys: int
    prefix: bytes = b""  # the slot as the keys' prefix (not stored)


def policy_hash(limits: Sequence[CompiledLimit]) -> bytes:
    described = [
        (limit.table, limit.identity, limit.algorithm, limit.spec.max_keys) for limit in limits
    ]
    return hashlib.sha256(pickle.dumps(described)).digest()


def apply_policy(
    txn: Any, dbs: Databases, limits: Sequence[CompiledLimit], now_us: int, unix_us: int
) -> None:
    """Adopt ``limits``: keep, rescale (at ``now_us``, a calendar window at ``unix_us``) or
    drop each table."""
    tables = read_tables(txn, dbs)
    kept: set[str] = set()
    for limit in limits:
        table = tables.get(limit.table)
        if table is not None and table.identity == limit.identity:
            if table.algorithm != limit.algorithm:
                at_us = unix_us if limit.calendar else now_us
                rescale_table(txn, dbs, table, limit.algorithm, at_us)
            if limit.spec.max_keys < table.max_keys:
                shrink_table(txn, dbs, table.slot, limit.spec.max_keys)
            slot = table.slot
            kept.add(limit.table)
        else:
            slot = read_int(txn, dbs, NEXT_SLOT)
            txn.put(NEXT_SLOT, TICK.pack(slot + 1), db=dbs.meta)
        record = (slot, limit.identity, limit.algorithm, limit.spec.max_keys)
        txn.put(b"table:" + limit.table.encode(), pickle.dumps(record), db=dbs.meta)
    for name, table in tables.items():
        if name in kept:
            continue
        drop_table(txn, dbs, name, table.slot)
        if name not in {limit.table for limit in limits}:
            txn.delete(b"table:" + name.encode(), db=dbs.meta)


def read_tables(txn: Any, dbs: Databases) -> dict[str, Table]:
    tables: dict[str, Table] = {}
    with txn.cursor(db=dbs.meta) as cursor:
        if cursor.set_range(b"table:"):
            for raw_name, raw in cursor:
                if not raw_name.startswith(b"table:"):
                    break
                slot, identity, algorithm, max_keys = pickle.loads(raw)
                tables[raw_name[6:].decode()] = Table(
                    slot, identity, algorithm, max_keys, SLOT.pack(slot)
                )
    return tables


def read_int(txn: Any, dbs: Databases, name: bytes) -> int:
    raw = txn.get(name, db=dbs.meta)
    return 0 if raw is None else int(TICK.unpack(raw)[0])


def slot_keys(txn: Any, db: Any, prefix: bytes) -> list[tuple[bytes, bytes]]:
    items: list[tuple[bytes, bytes]] = []
    with txn.cursor(db=db) as cursor:
        if cursor.set_range(prefix):
            for key, value in cursor:
                if not key.startswith(prefix):
                    break
                items.append((bytes(key), bytes(value)))
    return items


def rescale_table(txn: Any, dbs: Databases, table: Table, algorithm: Any, now_us: int) -> None:
    """Carry each key's state over with ``algorithm.rescale``; visits every key (reloads
    only)."""
    prefix = SLOT.pack(table.slot)
    for key, raw in slot_keys(txn, dbs.state, prefix):
        tick, state = decode_state(raw)
        new_state = algorithm.rescale(state, table.algorithm, now_us)
        if new_state is None:
            forget_key(txn, dbs, table.slot, key, tick)
        else:
            txn.put(key, encode_state(tick, new_state), db=dbs.state)


def shrink_table(txn: Any, dbs: Databases, slot: int, max_keys: int) -> None:
    count, evictions, expiries = table_counts(txn, dbs, slot)
    prefix = SLOT.pack(slot)
    while count > max_keys:
        oldest = oldest_key(txn, dbs, prefix)
        if oldest is None:
            break
        txn.delete(oldest, db=dbs.lru)
        txn.delete(prefix + oldest[12:], db=dbs.state)
        count -= 1
        evictions += 1
    txn.put(b"counts:" + prefix, COUNTS.pack(count, evictions, expiries), db=dbs.meta)


def drop_table(txn: Any, dbs: Databases, name: str, slot: int) -> None:
    """Free a table a reload removed or gave other keys; its evictions stay counted under
    its name (``dropped:``), so that a limit's evictions never go down."""
    prefix = SLOT.pack(slot)
    for db in (dbs.state, dbs.lru, dbs.held):
        for key, _ in slot_keys(txn, db, prefix):
            txn.delete(key, db=db)
    _, evictions, _ = table_counts(txn, dbs, slot)
    txn.delete(b"counts:" + prefix, db=dbs.meta)
    if evictions:
        dropped_key = DROPPED + name.encode()
        txn.put(dropped_key, TICK.pack(read_int(txn, dbs, dropped_key) + evictions),
                db=dbs.meta)  # fmt: skip


def forget_key(txn: Any, dbs: Databases, slot: int, key: bytes, tick: int) -> None:
    """Drop one key (``key`` with its slot prefix)."""
    prefix = SLOT.pack(slot)
    txn.delete(key, db=dbs.state)
    txn.delete(prefix + TICK.pack(tick) + key[4:], db=dbs.lru)
    count, evictions, expiries = table_counts(txn, dbs, slot)
    txn.put(b"counts:" + prefix, COUNTS.pack(count - 1, evictions, expiries), db=dbs.meta)


def table_counts(txn: Any, dbs: Databases, slot: int) -> tuple[int, int, int]:
    """A table's keys, evictions and expiries."""
    raw = txn.get(b"counts:" + SLOT.pack(slot), db=dbs.meta)
    return (0, 0, 0) if raw is None else COUNTS.unpack(raw)


def oldest_key(txn: Any, dbs: Databases, prefix: bytes) -> bytes | None:
    with txn.cursor(db=dbs.lru) as cursor:
        if cursor.set_range(prefix):
            key = bytes(cursor.key())
            if key.startswith(prefix):
                return key
    return None
