"""A copy of a record the database can hold: values it refuses replaced, and said so.

The agent chooses much of what a call record holds (its request body, the model name, a
prompt of token ids), and some values cannot be stored as captured: a token id outside
int32 does not fit the packed id arrays, Postgres refuses a NUL character in text and
a string longer than its column, no database takes a lone surrogate. ``storable`` is
tried only on a record the database refused (never on the happy path); the stored call
then says what was changed (a note in its ``error``, ``ids_missing``), and the writer
keeps the record as captured in the dead-letter file (``storage.quarantine``).
"""

from __future__ import annotations

import msgspec

from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.tables import Call, Choice

UNSTORABLE_IDS = "unstorable_ids"  # calls.ids_missing: ids outside int32 were not stored
MARK = "tracetap stored this call altered: "  # the note appended to calls.error

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
# Text columns that hold JSON: a NUL there is written as the JSON escape, which JSON
# readers decode back to the same string; in plain text it becomes U+FFFD.
_JSON_COLUMNS = frozenset({"request", "response", "upstream_request", "overlay"})
_IDENTITY = frozenset({"call_id", "episode_id"})  # never changed: it would be another id
_NULLABLE_COUNTS = ("prompt_tokens", "completion_tokens")


def _lengths(table) -> dict[str, int]:
    return {c.name: c.type.length for c in table.columns if getattr(c.type, "length", None)}


_CALL_LENGTHS = _lengths(Call.__table__)
_CHOICE_LENGTHS = _lengths(Choice.__table__)


def storable(record: CallRecord, dialect: str) -> tuple[CallRecord, list[str]]:
    """``record`` as ``dialect`` can store it and what was changed (empty: nothing)."""
    postgres = dialect == "postgresql"
    notes: list[str] = []
    low, high = _INT32 if postgres else _INT64
    changes: dict = {}
    for name in _NULLABLE_COUNTS:
        value = getattr(record, name)
        if value is not None and not low <= value <= high:
            changes[name] = None
            notes.append(f"{name} {value} out of range, not stored")
    if record.prompt_ids is not None and not _fits_int32(record.prompt_ids):
        changes.update(prompt_ids=None, prompt_ids_packed=None, prompt_source="none",
                       ids_missing=UNSTORABLE_IDS)
        notes.append("prompt_ids: a token id outside int32, ids not stored")
    changes.update(_texts(record, _CALL_LENGTHS, postgres, notes, ""))
    choices = [_choice(c, postgres, notes) for c in record.choices]
    if any(new is not old for new, old in zip(choices, record.choices)):
        changes["choices"] = choices
        if any(c.completion_ids is None and old.completion_ids is not None
               for c, old in zip(choices, record.choices)):
            changes["ids_missing"] = UNSTORABLE_IDS
    if not notes:
        return record, notes
    error = changes.get("error", record.error)
    changes["error"] = (f"{error}; " if error else "") + MARK + "; ".join(notes)
    return msgspec.structs.replace(record, **changes), notes


def _choice(choice: ChoiceRecord, postgres: bool, notes: list[str]) -> ChoiceRecord:
    where = f"choices[{choice.index}]."
    changes = _texts(choice, _CHOICE_LENGTHS, postgres, notes, where)
    if choice.completion_ids is not None and not _fits_int32(choice.completion_ids):
        changes.update(completion_ids=None, token_source="none")
        notes.append(where + "completion_ids: a token id outside int32, ids not stored")
    if choice.top_logprobs is not None:
        try:  # stored as JSON, journaled as msgpack (which has no ints over 64 bits)
            msgspec.json.encode(choice.top_logprobs)
            msgspec.msgpack.encode(choice.top_logprobs)
        except (TypeError, ValueError, OverflowError):
            changes["top_logprobs"] = None
            notes.append(where + "top_logprobs: not encodable, not stored")
    if choice.completion_logprobs is not None and not all(
            type(v) is float or type(v) is int for v in choice.completion_logprobs):
        changes["completion_logprobs"] = None
        notes.append(where + "completion_logprobs: not numbers, not stored")
    return msgspec.structs.replace(choice, **changes) if changes else choice


def _texts(struct, lengths: dict[str, int], postgres: bool, notes: list[str],
           where: str) -> dict:
    changes = {}
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        if not isinstance(value, str):
            continue
        column = "choice_index" if name == "index" else name
        if column in _IDENTITY:  # refused as it is: a changed id could be someone else's
            continue
        fixed = _text(value, column, postgres)
        if fixed != value:
            what = ("invalid characters replaced with U+FFFD"
                    if not postgres or "\x00" not in value
                    else "NUL written as \\u0000" if column in _JSON_COLUMNS
                    else "NUL replaced with U+FFFD")
            notes.append(f"{where}{name}: {what}")
        limit = lengths.get(column)
        if postgres and limit and len(fixed) > limit:
            notes.append(f"{where}{name}: {len(fixed)} characters cut to {limit}")
            fixed = fixed[:limit]
        if fixed != value:
            changes[name] = fixed
    return changes


def _text(value: str, column: str, postgres: bool) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: keep valid pairs, replace the rest
        value = value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if postgres and "\x00" in value:
        value = value.replace("\x00", "\\u0000" if column in _JSON_COLUMNS else "\ufffd")
    return value


def _fits_int32(ids: list) -> bool:
    low, high = _INT32
    try:
        return not ids or (low <= min(ids) and max(ids) <= high
                           and all(type(i) is int for i in ids))
    except TypeError:  # not all numbers
        return False

