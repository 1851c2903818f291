"""Harness variants in the viewer: ``tracetap compare`` and ``tracetap harnesses`` as pages.

The statistics are analysis.compare.compare and analysis.coverage.coverage themselves,
run on the episodes analysis.episodes.read loads (the same selection as the commands:
finished episodes, selectors as ``--baseline``/``--candidate``/``--where`` take them),
so a page and the command give the same Δ_B and interval for the same arguments. This
module only adds what a page needs: the episodes behind each fixed or broken task
(links), the factor-pair counts the coverage heatmap draws, and the interval plots
(viewer.interval_plots: per-level success, Δ_B).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence

import msgspec
from aiohttp import web

from tracetap.analysis.compare import Comparison, compare
from tracetap.analysis.coverage import Coverage, coverage
from tracetap.analysis.episodes import AnalysisError, Episode, read
from tracetap.analysis.held_out import Chooser, held_out
from tracetap.analysis.select import Selector, Success, parse_selector
from tracetap.storage.scan import EpisodeFilter
from tracetap.viewer.interval_plots import delta_plot, held_out_plot, level_plot
from tracetap.viewer.keys import SOURCE
from tracetap.viewer.params import BadParameter
from tracetap.viewer.render import page

MAX_CANDIDATES = 4
MAX_RESAMPLES = 20_000
MAX_FACTORS = 6  # the heatmap draws every pair of at most this many factors
MAX_LEVELS = 40  # levels per factor in a heatmap (the rest are counted, not drawn)
SHADES = 5  # success-rate classes of a heatmap cell


class Options(msgspec.Struct, kw_only=True):
    success: Success
    resamples: int = 2000
    seed: int = 0
    allow_unpaired: bool = False


class Chip(msgspec.Struct, kw_only=True):
    episode: Episode
    succeeded: bool  # by the page's success rule: what the verdict counts


class TaskLinks(msgspec.Struct, kw_only=True):
    """A fixed or broken task's episodes: those its verdict counted on each side, and those
    left out of it (integrity infra), shown apart so the chips add up to the verdict."""

    task: str
    baseline: list[Chip]
    candidate: list[Chip]
    left_out: list[Episode] = []

    def succeeded(self, side: str) -> int:
        return sum(c.succeeded for c in getattr(self, side))


# Error texts name the command's flags; the page has controls for them.
_CONTROLS = (("pass --allow-unpaired to drop them", "tick “drop unpaired tasks” to drop them"),
             ("--allow-unpaired", "“drop unpaired tasks”"),
             ("give at least one --candidate selection", "give a candidate selector"),
             ("--resamples", "Resamples"), ("--held-out", "Held-out configs"),
             ("--factor", "Factor"), ("--where", "Only episodes matching"))


def page_words(message: str) -> str:
    """An analysis error as the page's controls say it."""
    for flag, control in _CONTROLS:
        message = message.replace(flag, control)
    return message


class Cell(msgspec.Struct, kw_only=True):
    episodes: int
    success_rate: float | None
    shade: int  # 0 (never succeeded) .. SHADES - 1; -1 never ran


class Grid(msgspec.Struct, kw_only=True):
    factor: str  # rows
    other: str  # columns
    rows: list[str]
    columns: list[str]
    cells: list[list[Cell]]
    hidden: int  # levels not drawn (past MAX_LEVELS)


def _text(query: Mapping[str, str], name: str, limit: int = 512) -> str:
    value = query.get(name, "").strip()
    if len(value) > limit:
        raise BadParameter(f"{name} is longer than {limit} characters")
    return value


def _number(query: Mapping[str, str], name: str, default, kind, low, high):
    value = _text(query, name)
    try:
        number = kind(value) if value else default
    except ValueError:
        raise BadParameter(f"{name} must be a number") from None
    if not low <= number <= high:
        raise BadParameter(f"{name} must be between {low} and {high}")
    return number


def options(query: Mapping[str, str]) -> Options:
    outcomes = tuple(o.strip() for o in _text(query, "success").split(",") if o.strip())
    threshold = _number(query, "threshold", 1.0, float, -1e9, 1e9)
    return Options(success=Success(outcomes=outcomes or ("success",), threshold=threshold),
                   resamples=_number(query, "resamples", 2000, int, 1, MAX_RESAMPLES),
                   seed=_number(query, "seed", 0, int, 0, 2**31),
                   allow_unpaired=query.get("unpaired", "") == "yes")


def _selector(text: str, name: str) -> Selector:
    try:
        return parse_selector(text)
    except AnalysisError as exc:
        raise BadParameter(f"{name}: {exc}") from None


async def _episodes(request: web.Request, policies: bool,
                    costs: bool) -> tuple[list[Episode], list[Episode]]:
    """The finished episodes (what the commands read), and the others: not counted, but
    the page says how many of them its selections match."""
    reader = await request.app[SOURCE].reader()
    every = await read(reader, EpisodeFilter(finished_only=False), policies=policies,
                       costs=costs)
    return ([e for e in every if e.summary.finished_at is not None],
            [e for e in every if e.summary.finished_at is None])


async def variants_page(request: web.Request) -> web.Response:
    """``?baseline=SELECTOR&candidate=SELECTOR`` (candidate repeatable), as ``tracetap
    compare`` takes them; ``success`` (outcomes, comma-separated), ``threshold``,
    ``resamples``, ``seed``, ``unpaired=yes``."""
    query = request.query
    form = {"baseline": _text(query, "baseline"),
            "candidates": [c.strip() for c in query.getall("candidate", []) if c.strip()],
            "success": _text(query, "success"), "threshold": _text(query, "threshold"),
            "resamples": _text(query, "resamples"), "unpaired": query.get("unpaired") == "yes"}
    if not form["baseline"] and not form["candidates"]:
        return page(request, "variants.html", view="variants", form=form, result=None,
                    links=[], error=None)
    if not form["baseline"] or not form["candidates"]:
        raise BadParameter("give a baseline and a candidate selector, e.g. harness=A and "
                           "harness=B")
    if len(form["candidates"]) > MAX_CANDIDATES:
        raise BadParameter(f"at most {MAX_CANDIDATES} candidates")
    chosen = options(query)
    baseline = _selector(form["baseline"], "baseline")
    candidates = [_selector(c, "candidate") for c in form["candidates"]]
    policies = any(s.needs_policies for s in (baseline, *candidates))
    episodes, unfinished = await _episodes(request, policies, costs=True)
    running = [(s.text, n) for s in (baseline, *candidates)
               if (n := sum(s.matches(e) for e in unfinished))]
    try:
        # The paired bootstrap is CPU work: off the event loop, so other pages still answer.
        result = await asyncio.to_thread(
            compare, episodes, baseline, candidates, success=chosen.success,
            resamples=chosen.resamples, seed=chosen.seed, allow_unpaired=chosen.allow_unpaired)
    except AnalysisError as exc:
        return page(request, "variants.html", status=400, view="variants", form=form,
                    result=None, links=[], error=page_words(str(exc)))
    return page(request, "variants.html", view="variants", form=form, result=result,
                links=[task_links(result, episodes, baseline, s, chosen.success)
                       for s in candidates],
                error=None, delta_plot=delta_plot(result), running=running)


def task_links(result: Comparison, episodes: Sequence[Episode], baseline: Selector,
               candidate: Selector, success: Success) -> dict[str, TaskLinks]:
    """For each fixed or broken task: the episodes each side ran on it that Δ_B counts
    (with whether each succeeded), and the infra ones it left out."""
    mine = next(c for c in result.candidates if c.variant.selector == candidate.text)
    wanted = {*mine.flips.fixed, *mine.flips.broken}
    out = {t: TaskLinks(task=t, baseline=[], candidate=[], left_out=[]) for t in wanted}
    for e in episodes:
        links = out.get(e.task)
        side = None if links is None else "baseline" if baseline.matches(e) \
            else "candidate" if candidate.matches(e) else None
        if side is None:
            continue
        if e.integrity.infra:
            links.left_out.append(e)
        else:
            getattr(links, side).append(Chip(episode=e, succeeded=success(e)))
    return out


async def harnesses_page(request: web.Request) -> web.Response:
    """``?where=SELECTOR&factor=NAME`` (repeatable), ``success``, ``threshold``,
    ``held_out=SELECTOR``: the coverage ``tracetap harnesses`` prints, with each factor
    pair as a heatmap (and ``--held-out``'s report as a plot)."""
    query = request.query
    where_text = _text(query, "where")
    factors = [name.strip() for given in query.getall("factor", [])
               for name in given.split(",") if name.strip()]
    held_text = _text(query, "held_out")
    form = {"where": where_text, "factors": ", ".join(factors),
            "success": _text(query, "success"), "threshold": _text(query, "threshold"),
            "held_out": held_text}
    where = _selector(where_text, "where") if where_text else None
    held = _selector(held_text, "held_out") if held_text else None
    chosen = options(query)
    episodes, unfinished = await _episodes(request, bool(where and where.needs_policies),
                                           costs=False)
    if where is not None:
        episodes = [e for e in episodes if where.matches(e)]
        unfinished = [e for e in unfinished if where.matches(e)]
    try:
        report = coverage(episodes, success=chosen.success, factors=factors)
        if held is not None:
            report.held_out = held_out_of(report, episodes, held, chosen.success)
    except AnalysisError as exc:
        return page(request, "harnesses.html", view="harnesses", form=form, report=None,
                    grids=[], error=page_words(str(exc)))
    grids = heatmaps(report, episodes, chosen.success)
    return page(request, "harnesses.html", view="harnesses", form=form, report=report,
                grids=grids, error=None, level_plot=level_plot(report), running=len(unfinished),
                held_plot=held_out_plot(report.held_out) if report.held_out else None)


def held_out_of(report: Coverage, episodes: Sequence[Episode], selector: Selector,
                success: Success):
    """``tracetap harnesses --held-out SELECTOR``'s report, for the page."""
    levels: dict[str, list[str]] = defaultdict(list)
    for row in report.levels:
        levels[row.factor].append(row.level)
    return held_out(episodes, Chooser(selectors=(selector,)), success=success,
                    factors=report.factors, levels=levels)


def heatmaps(report: Coverage, episodes: Sequence[Episode], success: Success) -> list[Grid]:
    """One grid per pair of factors: episodes and success rate for each level pair."""
    names = report.factors[:MAX_FACTORS]
    levels: dict[str, list[str]] = defaultdict(list)
    for level in report.levels:
        levels[level.factor].append(level.level)
    counts: dict[tuple[str, str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for e in episodes:
        won = success(e)
        for f, g in itertools.combinations(names, 2):
            if f in e.factors and g in e.factors:
                cell = counts[(f, e.factors[f], g, e.factors[g])]
                cell[0] += 1
                cell[1] += won
    return [_grid(f, g, levels[f], levels[g], counts)
            for f, g in itertools.combinations(names, 2)]


def _grid(f: str, g: str, rows: list[str], columns: list[str], counts) -> Grid:
    def cell(a: str, b: str) -> Cell:
        n, wins = counts.get((f, a, g, b), (0, 0))
        if not n:
            return Cell(episodes=0, success_rate=None, shade=-1)
        rate = wins / n
        return Cell(episodes=n, success_rate=rate, shade=min(SHADES - 1, int(rate * SHADES)))

    shown_rows, shown_columns = rows[:MAX_LEVELS], columns[:MAX_LEVELS]
    return Grid(factor=f, other=g, rows=shown_rows, columns=shown_columns,
                cells=[[cell(a, b) for b in shown_columns] for a in shown_rows],
                hidden=len(rows) - len(shown_rows) + len(columns) - len(shown_columns))
