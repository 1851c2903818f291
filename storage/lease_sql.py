"""A replica's periodic statements as plain Postgres SQL, run on the connection its
intents keep (storage.held_insert): the lease each second and the cleanup of stored
intents. Through the pool and SQLAlchemy (checkout, compile, commit, check-in) they were
most of an idle replica's CPU; here each is the driver's prepared statement. They say
what ``Intents._renew`` and ``Intents._cleanup`` say through SQLAlchemy on SQLite, where
no connection is kept.
"""

from __future__ import annotations

from tracetap.storage.tables import Call, CallIntent, Replica

_LEASE = Replica.__tablename__
# The arguments, in this order (``lease_args``).
_COLUMNS = ("replica", "started_at", "settled_at", "incarnation", "journal", "state",
            "heartbeat_at")
_MOVED = ("incarnation", "journal", "state", "heartbeat_at")


def _upsert(moved: tuple[str, ...]) -> str:
    names = ", ".join(_COLUMNS)
    values = ", ".join(f"${i}" for i in range(1, len(_COLUMNS) + 1))
    changes = ", ".join(f"{c} = EXCLUDED.{c}" for c in moved)
    return (f"INSERT INTO {_LEASE} ({names}) VALUES ({values}) "
            f"ON CONFLICT (replica) DO UPDATE SET {changes}")


# A restarted replica's lease keeps its ``settled_at`` until its previous life's intents
# are resolved (``Intents.ready``); then it moves with each renewal.
RENEW_READY = _upsert((*_MOVED, "settled_at"))
RENEW_NOT_READY = _upsert(_MOVED)

CLEANUP = (f"DELETE FROM {CallIntent.__tablename__} AS i WHERE i.replica = $1 AND EXISTS "
           f"(SELECT 1 FROM {Call.__tablename__} AS c WHERE c.call_id = i.call_id)")


def lease_args(replica: str, started_at: float, settled_at: float, incarnation: str,
               journal: str | None, state: str, heartbeat_at: float) -> tuple:
    return (replica, started_at, settled_at, incarnation, journal, state, heartbeat_at)
