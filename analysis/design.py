"""A harness-factor space (factors.yaml / .json) and a pairwise covering design.

The space maps each factor to its levels: ``{"context": ["full", "window"], "retries":
[0, 3]}`` (YAML or JSON; levels are scalars, compared as text like analysis.episodes).

``cover`` proposes N configurations. Where a known construction fits the space
(analysis.arrays: k factors of L levels each, with L a prime power and k <= L + 1, or L =
2) and covers every pair in fewer configurations than greedy, its rows come first: the
optimum, each pair once (binary: at least once), each level equally often. Otherwise,
and past those rows, configurations are chosen one at a time, greedily (AETG-style,
deterministic): each new configuration starts from a factor-level pair covered least so
far, then fixes the other factors in a shuffled order (a fixed seed), each at the level
that completes most least-covered pairs (ties: the smallest sum of squared counts, then
the least used level); of up to 64 starts, the configuration completing most
least-covered pairs wins. Every pair is covered once before any twice when N allows;
past that the counts stay even (tests/test_coverage.py: within each factor pair they
differ by at most their mean). Greedy favours pairs over levels: a factor's levels can
differ by two (3^7, 5^5 continued; forcing them within one cost 3^4 five more
configurations to cover every pair, 2^3 two more).

How close to the optimum: no design covers every pair with fewer configurations than the
product of the two largest level counts (``Design.lower_bound``). Constructions reach it
for 3^3 and 3^4 (9), 4^5 (16), 5^5 (25), 7^8 (49), and for two-level factors the fewest
rows any design needs (6 for 2^10, 8 for 2^35; Kleitman and Spencer). Greedy reaches the
bound for 2^3, 4·3·2, 5·4·3·3·2·2 and 6·4·4·3·2·2; it needs 16 for 3^7 (optimum 12 to
15) and 19 for 3^13 (optimum 15). ``Design.covered_after`` reports the figure for the
space at hand.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import msgspec

from tracetap.analysis.arrays import binary_covering, orthogonal_array
from tracetap.analysis.episodes import AnalysisError
from tracetap.exporters.factors import level

_STARTS = 64  # least-covered pairs tried as starts per configuration


class Space(msgspec.Struct):
    factors: dict[str, list[str]]  # in file order, each level as text (analysis.episodes)
    # The levels as the file wrote them (3 stays a number), for the configs a run registers;
    # None: the texts are the values.
    values: dict[str, list[Any]] | None = None

    def value(self, factor: str, text: str) -> Any:
        if self.values is None:
            return text
        return self.values[factor][self.factors[factor].index(text)]

    def pairs(self) -> list[tuple[str, str, str, str]]:
        names = list(self.factors)
        return [
            (f, a, g, b)
            for f, g in itertools.combinations(names, 2)
            for a in self.factors[f]
            for b in self.factors[g]
        ]


class Design(msgspec.Struct, kw_only=True):
    configs: list[dict[str, str]]
    pairs: int  # factor-level pairs in the space
    uncovered: int  # of them, in no proposed configuration
    covered_after: int | None  # configurations needed to cover every pair (None: N too few)
    lower_bound: int  # no design covers every pair with fewer
    pair_min: int  # the least and most covered pair
    pair_max: int


def read_space(path: str | Path) -> Space:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise AnalysisError(f"cannot read the factor space {path}: {exc.strerror or exc}") from exc
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError:
        raw = _yaml(path, text)
    return _space(path, raw)


def _yaml(path: Path, text: str):
    try:
        import yaml
    except ImportError:  # only the tests need PyYAML; JSON works without it
        raise AnalysisError(
            f"{path} is not JSON, and reading YAML needs PyYAML "
            "(pip install pyyaml), or write the space as JSON"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise AnalysisError(
            f"{path} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}"
        ) from None


def _space(path: Path, raw) -> Space:
    shape = "a mapping of factor -> list of levels, like {context: [full, window], retries: [0, 3]}"
    if not isinstance(raw, dict) or not raw:
        raise AnalysisError(f"{path}: the factor space must be {shape}")
    factors: dict[str, list[str]] = {}
    values: dict[str, list[Any]] = {}
    for name, levels in raw.items():
        if not isinstance(name, str) or not isinstance(levels, list) or not levels:
            raise AnalysisError(
                f"{path}: factor {name!r} must name a non-empty list of levels ({shape})"
            )
        texts = [level(v) for v in levels]
        if None in texts:
            raise AnalysisError(
                f"{path}: factor {name!r} has a level that is not a scalar "
                f"(string, number, boolean or null): {levels!r}"
            )
        if len(set(texts)) != len(texts):
            raise AnalysisError(f"{path}: factor {name!r} lists a level twice: {levels!r}")
        factors[name] = texts
        values[name] = list(levels)
    return Space(factors, values)


def cover(space: Space, n: int) -> Design:
    """N configurations covering the space's level pairs as early and as evenly as
    possible: a known construction (analysis.arrays) where it covers every pair in fewer
    configurations than greedy does, then greedy from its counts; otherwise greedy."""
    if n < 1:
        raise AnalysisError("--select must be at least 1")
    greedy = _greedy(space, n, [])
    built = constructed(space)
    if built is not None and len(built) <= n and (
            greedy.covered_after is None or greedy.covered_after > len(built)):
        return _greedy(space, n, built)
    return greedy


def constructed(space: Space) -> list[dict[str, str]] | None:
    """An optimal covering design for a space of k factors of L levels each, when one is
    known: the orthogonal array for L a prime power and k <= L + 1, the binary covering
    array for L = 2 (analysis.arrays); None otherwise."""
    names = list(space.factors)
    sizes = {len(levels) for levels in space.factors.values()}
    if len(names) < 2 or len(sizes) != 1:
        return None
    (size,) = sizes
    rows = binary_covering(len(names)) if size == 2 else orthogonal_array(size, len(names))
    if rows is None:
        return None
    return [{f: space.factors[f][v] for f, v in zip(names, row, strict=True)} for row in rows]


def _greedy(space: Space, n: int, first: list[dict[str, str]]) -> Design:
    """``first``, then greedy configurations up to ``n`` in all."""
    names = list(space.factors)
    pairs = space.pairs()
    counts = dict.fromkeys(pairs, 0)
    used = {(f, v): 0 for f in names for v in space.factors[f]}
    order = {f: i for i, f in enumerate(names)}
    rng = random.Random(0)  # fixed: the same space and N give the same design
    configs: list[dict[str, str]] = []
    covered_after = None
    for number in range(1, n + 1):
        if number <= len(first):
            best = first[number - 1]
        else:
            best = _next(space, names, pairs, order, rng, counts, used)
        configs.append(best)
        for f, g in itertools.combinations(names, 2):
            counts[(f, best[f], g, best[g])] += 1
        for f in names:
            used[(f, best[f])] += 1
        # With one factor there are no pairs: covering means every level once.
        if covered_after is None and min(counts.values() if pairs else used.values()) > 0:
            covered_after = number
    sizes = sorted((len(v) for v in space.factors.values()), reverse=True)
    bound = sizes[0] * sizes[1] if len(sizes) > 1 else sizes[0]
    return Design(
        configs=configs,
        pairs=len(pairs),
        uncovered=sum(c == 0 for c in counts.values()),
        covered_after=covered_after,
        lower_bound=bound,
        pair_min=min(counts.values(), default=0),
        pair_max=max(counts.values(), default=0),
    )


def _next(space: Space, names: list[str], pairs: list, order: dict[str, int],
          rng: random.Random, counts: dict, used: dict) -> dict[str, str]:
    """The greedy configuration that completes most least-covered pairs."""
    low = min(counts.values(), default=0)
    starts = [p for p in pairs if counts[p] == low][:_STARTS] or [None]
    best, best_score = None, None
    for start in starts:
        rest = rng.sample(names, len(names))
        config = _complete(space, order, rest, counts, used, low, start)
        score = _score(config, counts, low)
        if best_score is None or score > best_score:
            best, best_score = config, score
    return best


def _complete(
    space: Space,
    order: dict[str, int],
    rest: list[str],
    counts: dict,
    used: dict,
    low: int,
    start: tuple[str, str, str, str] | None,
) -> dict[str, str]:
    config: dict[str, str] = {}
    if start is not None:
        config = {start[0]: start[1], start[2]: start[3]}
    for f in rest:
        if f in config:
            continue
        best, best_key = None, None
        for v in space.factors[f]:
            new = total = 0
            for g, w in config.items():
                c = counts[(f, v, g, w) if order[f] < order[g] else (g, w, f, v)]
                new += c == low
                total += c * c
            key = (-new, total, used[(f, v)])
            if best_key is None or key < best_key:
                best, best_key = v, key
        config[f] = best
    return {f: config[f] for f in order}


def _score(config: dict[str, str], counts: dict, low: int) -> tuple[int, int]:
    names = list(config)
    hit = [counts[(f, config[f], g, config[g])] for f, g in itertools.combinations(names, 2)]
    return (sum(c == low for c in hit), -sum(c * c for c in hit))
