"""An episode drawn as a tree: its lineages (the main agent, sub-agents, one-shot side calls
such as a title or a summary) and their calls, with the episode it is a sub-agent of and
the sub-agent episodes registered with it as their parent.

Lineages are the export's own (exporters.lineages.assign on the calls in arrival order),
so the tree shows the conversations exactly as trajectories/ splits them.
"""

from __future__ import annotations

import re

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.exporters.lineages import CallView, assign
from tracetap.storage.conversation import Readers
from tracetap.storage.details import call_bodies
from tracetap.storage.relatives import Relatives, TreeCall, relatives, tree_calls
from tracetap.viewer.conversation import turns

MAX_LISTED = 60  # calls listed per lineage; the rest are counted (the calls table has all)
# An agent names its lineages and their parents (X-Tracetap-Lineage, X-Tracetap-Parent):
# a chain of thousands must not make the page deep or long. A lineage nested MAX_DEPTH
# levels under its root has its children drawn beside it; lineages past MAX_DRAWN (in
# order of their first call) are only counted.
MAX_DEPTH = 8
MAX_DRAWN = 200
MAX_NAMED = 16  # side lineages whose first request is read for what they are for
START_CHARS = 4000  # of a side lineage's system prompt and first message, searched
# What a side conversation is for, from how its first request starts (a harness's title
# and summary prompts say so); the first that matches names it.
PURPOSES = (("summariser", re.compile(r"summar|compact", re.I)),
            ("title", re.compile(r"\btitle\b", re.I)))


class Node(msgspec.Struct, kw_only=True):
    id: str  # the lineage id: its first call's id
    kind: str  # main, sub-agent, one-shot, conversation, or the harness's name for it
    name: str | None  # X-Tracetap-Lineage, when the harness named it
    calls: list[TreeCall]
    children: list[Node] = []
    failed: int = 0
    root: bool = False  # drawn at the top of the tree

    @property
    def listed(self) -> list[TreeCall]:
        return self.calls[:MAX_LISTED]


class Tree(msgspec.Struct, kw_only=True):
    roots: list[Node]
    lineages: int
    family: Relatives
    hidden: int = 0  # lineages not drawn (past MAX_DRAWN)


SIDE = ("one-shot side call", "conversation")


def _kind(node: Node, main: Node | None, parent: str | None) -> str:
    if node is main:
        return "main"
    if parent is not None:
        return "sub-agent" if len(node.calls) > 1 else "one-shot side call"
    return "one-shot side call" if len(node.calls) == 1 else "conversation"


def build(calls: list[TreeCall], family: Relatives) -> Tree:
    of = assign(CallView(call_id=c.call_id, t_start=c.t_start, t_end=c.t_end,
                         conversation=c.conversation, lineage=c.lineage,
                         parent_lineage=c.parent_lineage, asked_tool=c.asked_tool)
                for c in calls)
    nodes: dict[str, Node] = {}
    parents: dict[str, str | None] = {}
    for c in calls:
        lineage = of[c.call_id]
        node = nodes.get(lineage.id)
        if node is None:
            node = nodes[lineage.id] = Node(id=lineage.id, kind="", name=c.lineage,
                                            calls=[], children=[])
            parents[lineage.id] = lineage.parent
        node.calls.append(c)
        node.failed += c.failed
    roots = [n for n in nodes.values() if parents[n.id] not in nodes]
    # The main agent: the root conversation with the most calls (the first of equals).
    main = max(roots, key=lambda n: len(n.calls), default=None)
    drawn = _drawn(nodes, parents, main)
    return Tree(roots=[n for n in drawn if n.root], lineages=len(nodes), family=family,
                hidden=len(nodes) - len(drawn))


def _drawn(nodes: dict[str, Node], parents: dict[str, str | None],
           main: Node | None) -> list[Node]:
    """The first MAX_DRAWN lineages, kinds set, each under its parent (or, past
    MAX_DEPTH, beside it)."""
    drawn = list(nodes.values())[:MAX_DRAWN]  # a parent's first call precedes its child's
    depth: dict[str, int] = {}
    holder: dict[str, str | None] = {}  # the node each is drawn under
    for node in drawn:
        node.kind = _kind(node, main, parents[node.id])
        parent = parents[node.id] if parents[node.id] in nodes else None
        if parent is not None and depth[parent] >= MAX_DEPTH:
            parent = holder[parent]  # beside its parent, at the deepest level drawn
        holder[node.id] = parent
        depth[node.id] = 0 if parent is None else depth[parent] + 1
        if parent is not None:
            nodes[parent].children.append(node)
        node.root = parent is None
    return drawn


def purpose(readers: Readers, endpoint: str, request: str | None) -> str | None:
    """``summariser`` or ``title`` when the request's system prompt or first message says
    so; None otherwise."""
    start = []
    for turn in turns(readers, endpoint, request, None):
        start.append(turn.text[:START_CHARS])
        if turn.role != "system":
            break
    text = "\n".join(start)[:START_CHARS]
    return next((name for name, said in PURPOSES if said.search(text)), None)


async def episode_tree(engine: AsyncEngine, readers: Readers, episode_id: str) -> Tree:
    tree = build(await tree_calls(engine, episode_id), await relatives(engine, episode_id))
    side = [n for n in _walk(tree.roots) if n.kind in SIDE][:MAX_NAMED]
    bodies = await call_bodies(engine, [n.id for n in side])
    for node in side:
        if node.id in bodies:
            node.kind = purpose(readers, *bodies[node.id][:2]) or node.kind
    return tree


def _walk(nodes: list[Node]):
    for node in nodes:
        yield node
        yield from _walk(node.children)


class Placement(msgspec.Struct, kw_only=True):
    """Where one call sits: its lineage, the lineage that started it (None for a root),
    and the episode's family (a root of a sub-agent episode: the parent episode)."""

    node: Node
    parent: Node | None
    family: Relatives
    index: int  # the call's place in its lineage, from 1


async def call_lineage(engine: AsyncEngine, readers: Readers, episode_id: str | None,
                       call_id: str) -> Placement | None:
    if episode_id is None:
        return None
    tree = await episode_tree(engine, readers, episode_id)
    parents = {child.id: node for node in _walk(tree.roots) for child in node.children}
    for node in _walk(tree.roots):
        for index, call in enumerate(node.calls, 1):
            if call.call_id == call_id:
                return Placement(node=node, parent=parents.get(node.id), family=tree.family,
                                 index=index)
    return None  # past the lineages drawn
