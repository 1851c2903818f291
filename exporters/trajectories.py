"""One episode's calls → training trajectories, by exact token prefix (pure: no I/O).

Nodes are (call, choice) pairs. Node c extends node p when p finished before c started
and c's prompt starts with p's prompt + p's completion; of those, the longest p is the
parent (ties: the most recent). Every leaf of the resulting forest is one row: the
root's prompt, then per edge the observation gap (mask 0) and the completion (mask 1).

A completion shared by several leaves is trainable (mask 1, its logprobs) in exactly one
row: the leaf reached by always following the earliest child. Elsewhere it is context
(mask 0, logprob 0). Text is never re-tokenized: a call without token ids is left out
(counted in ``left_out`` by why), or with ``keep_untokenized`` becomes a single-turn row of
its own, marked and never stitched.

split_reason says why a row is not the episode's main line, at the highest point where
it leaves it (the top of its trainable part):
  None            the main line: the episode's first root, earliest child at every step
  "sample"        a later choice of the same request (n > 1)
  "retry"         a request whose prompt equals an earlier request's prompt
  "branch"        a later, different continuation of the same context
  "non_prefix"    a new root: the prompt extends no earlier completion (context rewritten,
                  summarised; a sub-agent too, unless ``lineages`` puts it in a lineage of
                  its own: each lineage is merged on its own, with its own main line)
  "no_token_ids"  the upstream gave no token ids; a single-turn row, never stitched (only
                  with keep_untokenized: such rows are not training data)
  "compaction"    a "non_prefix" root whose prompt holds the summary an earlier call
                  wrote: the conversation compacted its history (exporters.compaction
                  marks it and links the segments after the rows are built)
  "vetoed"        a reply an overlay rejected (the model sampled again, docs/overlays.md):
                  a single-turn row of its own, never stitched, never a parent, so it is
                  never trained as part of the trajectory the harness went on with
Calls that did not succeed (status != "ok" or HTTP status != 200) are left out.

A "non_prefix" or "branch" row also says where its prompt left the context it was expected
to extend (a branch: a later sibling's, such as a turn whose stop string was cut):
the earlier finished (call, choice) whose prompt + completion shares the longest prefix with
it (ties: the most recent). ``drift_position`` is the first token that differs,
``drift_expected_token`` the earlier context's token there (None: it had ended),
``drift_received_token`` the new prompt's. Why it differs is found from the messages
(``exporters.drift``); with no earlier finished call the cause is "no_earlier_turn".
"""

from __future__ import annotations

from array import array
from bisect import insort
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Protocol

import msgspec

from tracetap.exporters.experts import trajectory_experts
from tracetap.exporters.policy import trajectory_runs

SPLIT_REASONS = (None, "sample", "retry", "branch", "non_prefix", "no_token_ids", "vetoed",
                 "compaction")


class ChoiceLike(Protocol):
    index: int
    finish_reason: str | None
    # int32 / float64 bytes in native order (storage.codec.native_ids), or any sequence
    completion_ids: bytes | Sequence[int] | None
    completion_logprobs: bytes | Sequence[float] | None


class CallLike(Protocol):
    call_id: str
    seq: int
    instance: str
    t_start: float
    t_end: float | None
    status: str
    http_status: int
    policy_version: str | None
    prompt_ids: bytes | Sequence[int] | None
    choices: Sequence[ChoiceLike]


class Trajectory(msgspec.Struct, kw_only=True, gc=False):  # data only: no cycles
    """One row. Token arrays are ``array`` objects: ``list(x)`` for plain lists."""

    trajectory_id: str
    call_ids: list[str]
    choice_indices: list[int]
    prompt_ids: array  # array('i')
    response_ids: array  # array('i')
    response_mask: array  # array('b'): 1 = sampled by the model and trainable here
    response_logprobs: array | None  # array('d'), 0 where mask is 0; None: not captured
    policy_versions: list[str | None]
    split_reason: str | None
    finish_reason: str | None
    # Where a "non_prefix" or "branch" row's prompt left the expected context (module doc):
    # the call whose prompt left it (not exported: the top of the row's trained part).
    split_call_id: str | None = None
    drift_call_id: str | None = None
    drift_choice_index: int | None = None
    drift_position: int | None = None
    drift_expected_token: int | None = None
    drift_received_token: int | None = None
    # Why, from the messages (exporters.drift.explain; exporters.history.CAUSES).
    drift_cause: str | None = None
    drift_message_index: int | None = None
    drift_expected_text: str | None = None
    drift_received_text: str | None = None
    # The conversation inside the episode the row belongs to (exporters.lineages).
    lineage_id: str | None = None
    parent_lineage_id: str | None = None
    # A "compaction" row: the row it continues and the call that wrote the summary.
    continues_trajectory_id: str | None = None
    summary_call_id: str | None = None
    # Off-policy tokens told apart: [start, end) runs of the completions' tokens in
    # response_ids with their policy version (None: unknown); whether the trained ones
    # mix versions (exporters.policy).
    response_policy_spans: list[dict] = []
    mixed_policy: bool = False
    # response_ids-aligned MoE routing, None without any (exporters.experts).
    response_routed_experts: list | None = None

    @property
    def num_turns(self) -> int:
        return len(self.call_ids)


_arrival = attrgetter("t_start", "instance", "seq")
_index = attrgetter("index")


class _Node:
    """A (call, choice). Token arrays stay bytes: lengths and positions are in bytes
    (4 per id), and prefix tests are memcmp."""

    __slots__ = ("call", "children", "choice", "completion", "end", "logprobs", "parent",
                 "prompt")

    def __init__(self, call: CallLike, choice: ChoiceLike):
        self.call = call
        self.choice = choice
        self.prompt = _packed(call.prompt_ids, "i")
        self.completion = _packed(choice.completion_ids, "i")
        self.logprobs = _logprobs(_packed(choice.completion_logprobs, "d", None),
                                  len(self.completion))
        self.end = len(self.prompt) + len(self.completion)
        self.parent: _Node | None = None
        self.children: list[_Node] = []

    def is_prefix_of(self, ids: bytes) -> bool:
        """ids starts with this node's prompt + completion."""
        return (self.end <= len(ids) and ids.startswith(self.prompt)
                and ids.startswith(self.completion, len(self.prompt)))


def build_trajectories(calls: Iterable[CallLike], *, keep_untokenized: bool = False,
                       left_out: dict[str, int] | None = None,
                       lineages: Mapping[str, object] | None = None) -> list[Trajectory]:
    """All rows of one episode: the prefix forest's leaves (then, with ``keep_untokenized``,
    calls without token ids as marked single-turn rows). Each (call, choice) left out for
    lack of ids is counted in ``left_out`` under why (the call's ``ids_missing`` reason
    when it has one, else ``no_token_ids``). ``lineages`` (call id → its lineage,
    exporters.lineages): each lineage is merged on its own, with a main line of its own."""
    ordered = sorted(calls, key=_arrival)
    nodes: list[_Node] = []
    single_turn: list[Trajectory] = []
    for call in ordered:
        vetoed = call.status == "vetoed"
        if not (call.status == "ok" or vetoed) or call.http_status != 200:
            continue
        choices = call.choices
        for choice in choices if len(choices) < 2 else sorted(choices, key=_index):
            tokenized = call.prompt_ids is not None and choice.completion_ids is not None
            if tokenized and vetoed:
                single_turn.append(_single_turn(call, choice, "vetoed"))
            elif tokenized:
                nodes.append(_Node(call, choice))
            elif keep_untokenized:
                single_turn.append(_single_turn(call, choice))
            elif left_out is not None:
                reason = getattr(call, "ids_missing", None) or "no_token_ids"
                left_out[reason] = left_out.get(reason, 0) + 1
    rows = []
    for part in _by_lineage(nodes, lineages):
        _link(part)
        rows += _tree_rows(part)
    for node in nodes:  # parent <-> children cycles would keep token buffers until a GC pass
        node.parent, node.children = None, []
    return [*rows, *single_turn]


def _by_lineage(nodes: list[_Node], lineages: Mapping[str, object] | None) -> list[list[_Node]]:
    """The nodes of each lineage, in arrival order; lineages by their first node."""
    if not lineages:
        return [nodes]
    parts: dict[int, list[_Node]] = {}
    for node in nodes:
        parts.setdefault(id(lineages.get(node.call.call_id)), []).append(node)
    return list(parts.values())


def _link(nodes: list[_Node]) -> None:
    """Give each node its parent: the longest finished earlier node its prompt extends."""
    by_end: dict[int, list[_Node]] = {}
    ends: list[int] = []  # distinct node ends, ascending
    for node in nodes:
        node.parent = _parent_of(node, by_end, ends)
        if node.parent is not None:
            node.parent.children.append(node)
        if node.end not in by_end:
            by_end[node.end] = []
            insort(ends, node.end)
        by_end[node.end].append(node)


def _parent_of(node: _Node, by_end: dict[int, list[_Node]], ends: list[int]) -> _Node | None:
    prompt, start, call = node.prompt, node.call.t_start, node.call
    for i in range(len(ends) - 1, -1, -1):
        if ends[i] > len(prompt):
            continue
        for candidate in reversed(by_end[ends[i]]):  # the most recent first
            t_end = candidate.call.t_end
            if candidate.call is call or t_end is None or t_end > start:
                continue
            if candidate.is_prefix_of(prompt):
                return candidate
    return None


def _tree_rows(nodes: list[_Node]) -> list[Trajectory]:
    roots = [n for n in nodes if n.parent is None]
    first_of_call: dict[str, _Node] = {}
    for node in nodes:
        first_of_call.setdefault(node.call.call_id, node)
    rows = []
    stack = list(reversed(roots))
    while stack:  # depth first, earliest child first: rows come out in a stable order
        node = stack.pop()
        if node.children:
            stack.extend(reversed(node.children))
            continue
        path = [node]
        while path[-1].parent is not None:
            path.append(path[-1].parent)
        path.reverse()
        top = len(path) - 1  # path[top:] is trainable in this row
        while top > 0 and path[top - 1].children[0] is path[top]:
            top -= 1
        reason = _reason(path[top], roots[0], first_of_call, nodes)
        row = _row(path, top, reason)
        if reason in ("non_prefix", "branch"):  # a branch left a sibling's context
            _diverged(row, path[top], nodes)
        rows.append(row)
    return rows


def _diverged(row: Trajectory, root: _Node, nodes: list[_Node]) -> None:
    """Record where ``root``'s prompt left the earlier context it shares most with."""
    prompt, call = root.prompt, root.call
    best, best_len = None, -1
    for node in nodes:
        if node is root:
            break  # nodes are in arrival order: only earlier ones
        t_end = node.call.t_end
        if node.call is call or t_end is None or t_end > call.t_start:
            continue
        shared = _shared_prefix(prompt, node.prompt, node.completion)
        if shared >= best_len:
            best, best_len = node, shared
    row.split_call_id = call.call_id
    if best is None:
        row.drift_cause = "no_earlier_turn"
        return
    context = best.prompt + best.completion
    row.drift_call_id, row.drift_choice_index = best.call.call_id, best.choice.index
    row.drift_position = best_len // 4
    row.drift_expected_token = _token_at(context, best_len)
    row.drift_received_token = _token_at(prompt, best_len)


def _shared_prefix(ids: bytes, prompt: bytes, completion: bytes) -> int:
    """Bytes (a multiple of 4) that ``ids`` shares with ``prompt + completion``."""
    context = prompt + completion
    low, high = 0, min(len(ids), len(context)) // 4  # tokens; the answer is in [low, high]
    while low < high:  # each probe a slice compare (memcmp): no Python loop per token
        mid = (low + high + 1) // 2
        if ids[:4 * mid] == context[:4 * mid]:
            low = mid
        else:
            high = mid - 1
    return 4 * low


def _token_at(ids: bytes, at: int) -> int | None:
    return array("i", ids[at:at + 4])[0] if at + 4 <= len(ids) else None


def _reason(top: _Node, first_root: _Node, first_of_call: dict[str, _Node],
            nodes: list[_Node]) -> str | None:
    if top is first_root:
        return None
    if first_of_call[top.call.call_id] is not top:
        return "sample"
    earlier = nodes[:nodes.index(top)]
    if any(n.prompt == top.prompt for n in earlier):
        return "retry"
    return "non_prefix" if top.parent is None else "branch"


def _row(path: list[_Node], top: int, reason: str | None) -> Trajectory:
    root, leaf = path[0], path[-1]
    # Every edge is an exact prefix, so the response is the leaf's context past the root.
    response = array("i", leaf.prompt[len(root.prompt):])
    response.frombytes(leaf.completion)
    mask: list[bytes] = []
    logprobs: list[bytes] | None = []
    previous_end = len(root.prompt)
    for i, node in enumerate(path):
        gap = (len(node.prompt) - previous_end) // 4  # in tokens from here on
        n = len(node.completion) // 4
        previous_end = node.end
        mask.append(bytes(gap))
        mask.append(b"\x01" * n if i >= top else bytes(n))
        if logprobs is None:
            continue
        logprobs.append(bytes(8 * gap))
        if i < top:
            logprobs.append(bytes(8 * n))
        elif node.logprobs is not None:
            logprobs.append(node.logprobs)
        else:  # a trainable turn without captured logprobs: say "unknown", never guess
            logprobs = None
    runs, mixed = trajectory_runs(
        (n.call, n.choice, (len(n.prompt) - len(root.prompt)) // 4, len(n.completion) // 4,
         i >= top) for i, n in enumerate(path))
    return Trajectory(
        response_policy_spans=runs,
        mixed_policy=mixed,
        response_routed_experts=trajectory_experts(
            ((n.choice, (len(n.prompt) - len(root.prompt)) // 4) for n in path), len(response)),
        trajectory_id=f"{leaf.call.call_id}:{leaf.choice.index}",
        call_ids=[n.call.call_id for n in path],
        choice_indices=[n.choice.index for n in path],
        prompt_ids=array("i", root.prompt),
        response_ids=response,
        response_mask=array("b", b"".join(mask)),
        response_logprobs=None if logprobs is None else array("d", b"".join(logprobs)),
        policy_versions=[n.call.policy_version for n in path],
        split_reason=reason,
        finish_reason=leaf.choice.finish_reason,
    )


def _single_turn(call: CallLike, choice: ChoiceLike,
                 reason: str = "no_token_ids") -> Trajectory:
    response = array("i", _packed(choice.completion_ids, "i"))
    logprobs = _logprobs(_packed(choice.completion_logprobs, "d", None), len(response) * 4)
    runs, mixed = trajectory_runs([(call, choice, 0, len(response), True)])
    return Trajectory(
        response_policy_spans=runs,
        mixed_policy=mixed,
        response_routed_experts=trajectory_experts([(choice, 0)], len(response)),
        trajectory_id=f"{call.call_id}:{choice.index}",
        call_ids=[call.call_id],
        choice_indices=[choice.index],
        prompt_ids=array("i", _packed(call.prompt_ids, "i")),
        response_ids=response,
        response_mask=array("b", b"\x01" * len(response)),
        response_logprobs=None if logprobs is None else array("d", logprobs),
        policy_versions=[call.policy_version],
        split_reason=reason,
        finish_reason=choice.finish_reason,
    )


def _logprobs(values: bytes | None, id_bytes: int) -> bytes | None:
    """The logprobs of a completion of ``id_bytes``; None unless they pair one to one
    with its ids (an empty completion has all of its none)."""
    if id_bytes == 0:
        return b""
    return values if values is not None and len(values) == 2 * id_bytes else None


def _packed(values: bytes | Sequence | None, code: str, none: bytes | None = b"") -> bytes | None:
    """Token data as bytes of C type ``code`` (native order): storage's bytes as they are,
    any other sequence (plain lists from Python callers) packed once."""
    if values is None:
        return none
    if type(values) is bytes:
        return values
    return array(code, values).tobytes()
