"""An episode drawn as a tree: its lineages (the main agent, sub-agents, one-shot side calls
such as a title or a summary) and their calls, with the episode it is a sub-agent of and
the sub-agent episodes registered with it as their parent.

Lineages are the export's own (exporters.lineages.assign on the calls in arrival order),
so the tree shows the conversations exactly as trajectories/ splits them.
"""

from __future__ import annotations

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.exporters.lineages import CallView, assign
from tracetap.storage.relatives import Relatives, TreeCall, relatives, tree_calls

MAX_LISTED = 60  # calls listed per lineage; the rest are counted (the calls table has all)


class Node(msgspec.Struct, kw_only=True):
    id: str  # the lineage id: its first call's id
    kind: str  # main, sub-agent, one-shot, conversation, or the harness's name for it
    name: str | None  # X-Tracetap-Lineage, when the harness named it
    calls: list[TreeCall]
    children: list[Node] = []
    failed: int = 0

    @property
    def listed(self) -> list[TreeCall]:
        return self.calls[:MAX_LISTED]


class Tree(msgspec.Struct, kw_only=True):
    roots: list[Node]
    lineages: int
    family: Relatives


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
    for node in nodes.values():
        node.kind = _kind(node, main, parents[node.id])
        parent = parents[node.id]
        if parent in nodes:
            nodes[parent].children.append(node)
    return Tree(roots=roots, lineages=len(nodes), family=family)


async def episode_tree(engine: AsyncEngine, episode_id: str) -> Tree:
    return build(await tree_calls(engine, episode_id), await relatives(engine, episode_id))
