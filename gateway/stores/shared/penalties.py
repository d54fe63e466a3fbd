"""Penalties shared by the workers of one gateway (``--workers N``): one limit's penalty boxes
in an LMDB environment of their own beside the shared store's, so a key blocked by one worker
is refused by all of them.

A look is one read transaction (only for limits with a penalty); a strike, a block or an
unblock one write transaction. Without ``writemap`` LMDB writes through ``write()``: a full
disk is an error, never a signal. At most ``max_keys`` entries per limit: past that, entries
that say nothing any more go first, then an eighth of the rest (in key order, as LMDB keeps
them).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import lmdb

from gateway.algorithms.penalty_box import CLEAR, PenaltyBox, PenaltyState

SUBDIR: Final = "penalties"
MAP_BYTES: Final = 256 << 20  # sparse: the file grows with what is written
_RECORD: Final = struct.Struct("<qqq")
_envs: dict[Path, lmdb.Environment] = {}


def _env(path: Path) -> lmdb.Environment:
    """One environment per directory and process (LMDB allows one open per process)."""
    env = _envs.get(path)
    if env is None:
        path.mkdir(parents=True, exist_ok=True)
        env = _envs[path] = lmdb.open(
            str(path), map_size=MAP_BYTES, max_dbs=256, sync=False, metasync=False
        )
    return env


def _key(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


class SharedPenaltyTable:
    """``stores.penalty_table.PenaltyTable``'s interface over LMDB."""

    def __init__(self, box: PenaltyBox, max_keys: int, directory: Path, limit_name: str) -> None:
        self.box = box
        self.max_keys = max_keys
        self._path = directory / SUBDIR
        self._name = limit_name.encode()
        self._db: Any = None

    def _open(self) -> tuple[lmdb.Environment, Any]:
        env = _env(self._path)
        if self._db is None:
            self._db = env.open_db(self._name)
        return env, self._db

    def __len__(self) -> int:
        env, db = self._open()
        with env.begin(db=db) as txn:
            return int(txn.stat(db)["entries"])

    def blocked_until(self, key: str, now_us: int) -> int:
        env, db = self._open()
        with env.begin(db=db) as txn:
            raw = txn.get(_key(key))
        if raw is None:
            return 0
        return self.box.blocked_until(_RECORD.unpack(raw), now_us)

    def strike(self, key: str, now_us: int) -> int:
        env, db = self._open()
        name = _key(key)
        with env.begin(write=True, db=db) as txn:
            raw = txn.get(name)
            state: PenaltyState = _RECORD.unpack(raw) if raw is not None else CLEAR
            state = self.box.strike(state, now_us)
            if raw is None and txn.stat(db)["entries"] >= self.max_keys:
                self._make_room(txn, now_us)
            txn.put(name, _RECORD.pack(*state))
        return state[2] if state[2] > now_us and state[1] == 0 else 0

    def block(self, key: str, until_us: int) -> None:
        env, db = self._open()
        with env.begin(write=True, db=db) as txn:
            if txn.get(_key(key)) is None and txn.stat(db)["entries"] >= self.max_keys:
                self._make_room(txn, until_us)
            txn.put(_key(key), _RECORD.pack(0, 0, until_us))

    def clear(self, key: str) -> bool:
        env, db = self._open()
        with env.begin(write=True, db=db) as txn:
            return bool(txn.delete(_key(key)))

    def blocked(self, now_us: int) -> Iterator[tuple[str, int]]:
        env, db = self._open()
        with env.begin(db=db) as txn:
            found = [
                (name.decode("utf-8", "surrogateescape"), _RECORD.unpack(raw)[2])
                for name, raw in txn.cursor()
            ]
        return ((key, until) for key, until in found if until > now_us)

    def _make_room(self, txn: Any, now_us: int) -> None:
        box = self.box
        idle = [name for name, raw in txn.cursor() if box.idle(_RECORD.unpack(raw), now_us)]
        for name in idle:
            txn.delete(name)
        entries = int(txn.stat(self._db)["entries"])
        if entries >= self.max_keys:
            oldest = [name for name, _ in txn.cursor()][: max(1, entries // 8)]
            for name in oldest:
                txn.delete(name)
