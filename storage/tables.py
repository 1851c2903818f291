"""SQLAlchemy models. Alembic migrations create these; a test keeps the two in sync."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "pk": "pk_%(table_name)s",
}


# A call that failed: not a 200, or not captured whole ("passthrough" is a relayed,
# uncaptured path such as count_tokens: not a failure).
FAILED_SQL = "http_status <> 200 OR status NOT IN ('ok', 'passthrough')"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Episode(Base):
    __tablename__ = "episodes"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    group_id: Mapped[str | None] = mapped_column(String(128), index=True)
    # Indexed for the viewer's filters and sorts (migration 0002).
    task_id: Mapped[str | None] = mapped_column(String(256), index=True)
    harness_name: Mapped[str | None] = mapped_column(String(256), index=True)
    harness_config: Mapped[str | None] = mapped_column(Text)  # JSON
    meta: Mapped[str | None] = mapped_column("metadata", Text)  # JSON
    # sha256 of the per-episode API key; the key itself is never stored.
    api_key_hash: Mapped[str | None] = mapped_column(String(64), unique=True)
    registered: Mapped[bool] = mapped_column(Boolean, default=False)
    # When registration committed it: processes follow new registrations by it (0008).
    registered_at: Mapped[float | None] = mapped_column(Float, index=True)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    finished_at: Mapped[float | None] = mapped_column(Float, index=True)
    reward: Mapped[float | None] = mapped_column(Float, index=True)
    rewards: Mapped[str | None] = mapped_column(Text)  # JSON {name: value}
    outcome: Mapped[str | None] = mapped_column(String(256), index=True)
    info: Mapped[str | None] = mapped_column(Text)  # JSON
    # The episode this one is a sub-agent of (registration field ``parent``, 0010).
    parent_id: Mapped[str | None] = mapped_column(String(128), index=True)  # indexed: 0015
    # How many finishes changed its result (0014): 1 for the first; a finish that repeats
    # the stored result changes nothing (docs/export.md, finish_seq).
    finish_seq: Mapped[int | None] = mapped_column(Integer)


class Call(Base):
    __tablename__ = "calls"

    call_id: Mapped[str] = mapped_column(String(36), primary_key=True)  # UUIDv7
    episode_id: Mapped[str | None] = mapped_column(String(128))
    seq: Mapped[int] = mapped_column(Integer)
    instance: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(32))
    model: Mapped[str | None] = mapped_column(String(256))
    policy_version: Mapped[str | None] = mapped_column(String(128))
    stream: Mapped[bool] = mapped_column(Boolean)
    upstream: Mapped[str | None] = mapped_column(String(512))
    request: Mapped[str | None] = mapped_column(Text)
    response: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(32))
    http_status: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    t_start: Mapped[float] = mapped_column(Float)
    t_first_byte: Mapped[float | None] = mapped_column(Float)
    t_end: Mapped[float | None] = mapped_column(Float)
    upstream_latency: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    prompt_ids: Mapped[bytes | None] = mapped_column(LargeBinary)  # int32 LE
    # storage.records.PROMPT_SOURCES; null only on rows stored before revision 0003.
    prompt_source: Mapped[str | None] = mapped_column(String(16))
    # What the engine was given when it differs from request (translated, repaired).
    upstream_request: Mapped[str | None] = mapped_column(Text)
    # Why some token ids are missing, when they are (proxy.tokens.resolve.REMEDIES).
    ids_missing: Mapped[str | None] = mapped_column(String(32))
    # JSON: overlay name, events, the reply the harness got when rewritten (0004).
    overlay: Mapped[str | None] = mapped_column(Text)
    # JSON {field: count}: what translation to chat left out of the request (0006).
    translation_dropped: Mapped[str | None] = mapped_column(Text)
    # The conversation the call belongs to (0010, exporters.lineages): the harness's own
    # names from X-Tracetap-Lineage / X-Tracetap-Parent, and the hashes of the request's
    # start (system prompt; system prompt and first message) that detect it otherwise.
    lineage: Mapped[str | None] = mapped_column(String(128))
    parent_lineage: Mapped[str | None] = mapped_column(String(128))
    conversation: Mapped[str | None] = mapped_column(String(40))
    # When the writer committed the row: the watermark for incremental export.
    stored_at: Mapped[float] = mapped_column(Float, index=True)
    # Since revision 0007 the prompt ids and the bodies are stored as references to
    # ``blocks`` (storage.blocks: 20-byte entries, hash and length) and the inline columns
    # above (prompt_ids, request, upstream_request, response) are null; rows stored before
    # keep them inline. storage.inflate reads both.
    prompt_refs: Mapped[bytes | None] = mapped_column(LargeBinary)
    request_refs: Mapped[bytes | None] = mapped_column(LargeBinary)
    upstream_request_refs: Mapped[bytes | None] = mapped_column(LargeBinary)
    response_refs: Mapped[bytes | None] = mapped_column(LargeBinary)

    __table_args__ = (
        Index(None, "episode_id", "t_start"),
        # The episodes whose calls failed: few rows, so the viewer's status filter reads
        # this small index instead of every call.
        Index("ix_calls_failed", "episode_id", postgresql_where=text(FAILED_SQL),
              sqlite_where=text(FAILED_SQL)),
    )


class Choice(Base):
    __tablename__ = "choices"

    call_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    choice_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    text: Mapped[str | None] = mapped_column(Text)
    completion_ids: Mapped[bytes | None] = mapped_column(LargeBinary)  # int32 LE
    completion_logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)  # float64 LE
    top_logprobs: Mapped[str | None] = mapped_column(Text)  # JSON
    token_source: Mapped[str] = mapped_column(String(32))  # storage.records.TOKEN_SOURCES
    # Since revision 0007 text, completion_ids and completion_logprobs are stored as one
    # compressed block each (references as in calls; the inline columns null).
    text_refs: Mapped[bytes | None] = mapped_column(LargeBinary)
    completion_ids_refs: Mapped[bytes | None] = mapped_column(LargeBinary)
    completion_logprobs_refs: Mapped[bytes | None] = mapped_column(LargeBinary)
    # JSON [[start_token, version | null], ...], null when every token is from the
    # call's policy_version (storage.policy_spans; revision 0009).
    policy_spans: Mapped[str | None] = mapped_column(Text)
    # The MoE routing of each completion token, one compressed block (storage.experts;
    # revision 0009); null unless the proxy ran with --routed-experts.
    routed_experts_refs: Mapped[bytes | None] = mapped_column(LargeBinary)


class Block(Base):
    """A content-addressed block of prompt ids or body text, stored once however many
    calls reference it (storage.blocks). Deleted only by prune's sweep, and only when no
    call references it (storage.retention)."""

    __tablename__ = "blocks"

    hash: Mapped[bytes] = mapped_column(LargeBinary(16), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)  # a format byte, then the contents


class CallText(Base):
    """A call the viewer's search can find (storage.search_index: the words of the turn
    it added, its answer, its error; not the text, since 0012). Full-text indexed: on
    Postgres the column ``words`` with a GIN index of its words' hash buckets (0016,
    storage.search.PG_WORDS; not modelled, SQLite has none), on SQLite the contentless
    FTS5 table ``call_text_fts``
    the writer fills beside it (``id`` is its rowid: AUTOINCREMENT, never reused, so a
    posting outlives no row it could be mistaken for)."""

    __tablename__ = "call_text"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), Identity(),
                                    primary_key=True)
    call_id: Mapped[str] = mapped_column(String(36), unique=True)
    episode_id: Mapped[str | None] = mapped_column(String(128), index=True)


class Control(Base):
    """What every proxy process on one database shares: the pause state, the policy
    version, one heartbeat row per running process (``worker:<instance>``), and on SQLite
    each change topic's serial (``notice:<topic>``, storage.notify)."""

    __tablename__ = "controls"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[str | None] = mapped_column(Text)
    # Raised by one on every change, in the database: processes apply a row only when its
    # serial is newer than the one they applied (clocks of replicas may disagree).
    serial: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[float] = mapped_column(Float)


class EpisodeBudget(Base):
    """One episode's budget and what its calls spent and hold, shared by every process on
    the database: admission is one conditional UPDATE (``storage.budget_ledger``)."""

    __tablename__ = "episode_budgets"

    episode_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    max_calls: Mapped[int | None] = mapped_column(Integer)
    max_tokens: Mapped[int | None] = mapped_column(BigInteger)
    max_seconds: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[float] = mapped_column(Float)  # wall clock: replicas share it
    calls: Mapped[int] = mapped_column(Integer, default=0)
    tokens_used: Mapped[int] = mapped_column(BigInteger, default=0)
    # Held by calls in flight: reserved at admission, released when each call settles.
    tokens_reserved: Mapped[int] = mapped_column(BigInteger, default=0)


class OverlayPatch(Base):
    """A runtime overlay patch (0013): Python source an episode names as its overlay, so
    every process on the database runs the same code for it (docs/overlays.md)."""

    __tablename__ = "overlay_patches"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))  # of the source's UTF-8 bytes
    source: Mapped[str] = mapped_column(Text)
    hooks: Mapped[str] = mapped_column(Text)  # JSON list: the hooks it defines
    after_model_sees: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[float] = mapped_column(Float)


class CallIntent(Base):
    """A call a replica admitted whose row is not stored yet (0014, storage.intents):
    written off the request path before the call is answered, deleted once the call's
    row (or its tombstone) is stored. Export holds its episode back meanwhile."""

    __tablename__ = "call_intents"

    call_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    episode_id: Mapped[str | None] = mapped_column(String(128), index=True)
    replica: Mapped[str] = mapped_column(String(64), index=True)
    incarnation: Mapped[str] = mapped_column(String(32))  # the process that admitted it
    admitted_at: Mapped[float] = mapped_column(Float)


class Replica(Base):
    """One replica's lease (0014, storage.replicas): every call it admitted before
    ``settled_at`` has its intent stored; ``state`` open (running, or gone without
    saying), closed (stopped with its journal written) or lost (an operator said so)."""

    __tablename__ = "replicas"

    replica: Mapped[str] = mapped_column(String(64), primary_key=True)  # its journal's id
    incarnation: Mapped[str] = mapped_column(String(32))
    journal: Mapped[str | None] = mapped_column(String(512))  # host:directory, for operators
    state: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    settled_at: Mapped[float] = mapped_column(Float)


class Annotation(Base):
    """A person's label, comment or corrected reward (0015, storage.annotations) on an
    episode, a call (``call_id``) or a token span of one (``choice_index``,
    ``token_start``..``token_end``, end exclusive). A corrected reward sits beside the
    episode's own ``reward``, which it never changes."""

    __tablename__ = "annotations"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), Identity(),
                                    primary_key=True)
    episode_id: Mapped[str] = mapped_column(String(128), index=True)
    call_id: Mapped[str | None] = mapped_column(String(36), index=True)
    choice_index: Mapped[int | None] = mapped_column(Integer)
    token_start: Mapped[int | None] = mapped_column(Integer)
    token_end: Mapped[int | None] = mapped_column(Integer)
    label: Mapped[str | None] = mapped_column(String(64))
    comment: Mapped[str | None] = mapped_column(Text)
    corrected_reward: Mapped[float | None] = mapped_column(Float)
    author: Mapped[str] = mapped_column(String(128))  # the viewer session, or the API's
    source: Mapped[str] = mapped_column(String(16))  # viewer or api
    created_at: Mapped[float] = mapped_column(Float)


metadata = Base.metadata
