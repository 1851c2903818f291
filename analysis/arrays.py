"""Covering arrays of strength 2 from known constructions, where they beat greedy.

A design covers a space when every pair of levels of every two factors occurs in some
configuration. Two classical constructions reach the optimum for the spaces they fit:

- ``orthogonal_array(q, k)``: ``k <= q + 1`` factors of ``q`` levels each, ``q`` a prime
  power (2, 3, 4, 5, 7, 8, 9, ...): the Bush/Rao construction over the field GF(q). Row
  (a, b) of the q² rows holds ``a`` in the first column and ``a·x + b`` in the column of
  each field element ``x``; any two columns show every pair of values exactly once. No
  design has fewer rows (the two factors' q·q pairs each need a row of their own).
- ``binary_covering(k)``: ``k`` two-level factors in the fewest rows N that any design
  needs (Kleitman and Spencer, 1973: the least N with C(N-1, ceil(N/2)) >= k; 6 rows for
  up to 10 factors, 8 for up to 35). Row 0 is all zeros; each column is a different set of
  ceil(N/2) of the other N-1 rows. Two such sets of the same size each have a row the
  other lacks (pairs 1,0 and 0,1) and, being more than half, a row in common (1,1).

In both each level occurs equally often in a column (binary: within one, for odd N).
"""

from __future__ import annotations

import itertools
import math


def orthogonal_array(q: int, k: int) -> list[list[int]] | None:
    """q² rows of k columns with values 0..q-1, every pair of columns showing every pair
    of values once; None when q is not a prime power or k > q + 1."""
    field = _field(q)
    if field is None or not 2 <= k <= q + 1:
        return None
    add, mul = field
    rows = []
    for a in range(q):
        for b in range(q):
            rows.append([a, *(add[mul[a][x]][b] for x in range(k - 1))])
    return rows


def binary_rows(k: int) -> int:
    """The fewest rows covering every pair of k two-level factors."""
    n = 4
    while math.comb(n - 1, (n + 1) // 2) < k:
        n += 1
    return n


def binary_covering(k: int) -> list[list[int]]:
    """binary_rows(k) rows of k columns of 0/1 covering every pair of columns."""
    n = binary_rows(k)
    columns = list(itertools.islice(itertools.combinations(range(1, n), (n + 1) // 2), k))
    return [[int(row in ones) for ones in columns] for row in range(n)]


def _field(q: int) -> tuple[list[list[int]], list[list[int]]] | None:
    """GF(q)'s addition and multiplication tables (elements 0..q-1: the coefficients of a
    polynomial over GF(p), base p), or None when q is not a prime power."""
    p = next((d for d in range(2, q + 1) if q % d == 0), None) if q >= 2 else None
    if p is None:
        return None
    m = round(math.log(q, p))
    if p**m != q:
        return None
    modulus = _irreducible(p, m)

    def digits(x: int) -> list[int]:
        return [(x // p**i) % p for i in range(m)]

    def number(ds: list[int]) -> int:
        return sum(d * p**i for i, d in enumerate(ds))

    def times(x: int, y: int) -> int:
        product = [0] * (2 * m - 1)
        for i, a in enumerate(digits(x)):
            for j, b in enumerate(digits(y)):
                product[i + j] = (product[i + j] + a * b) % p
        for top in range(2 * m - 2, m - 1, -1):  # reduce by the monic modulus
            c = product[top]
            if c:
                for i, d in enumerate(modulus):
                    product[top - m + i] = (product[top - m + i] - c * d) % p
        return number(product[:m])

    add = [[number([(a + b) % p for a, b in zip(digits(x), digits(y), strict=True)])
            for y in range(q)] for x in range(q)]
    return add, [[times(x, y) for y in range(q)] for x in range(q)]


def _irreducible(p: int, m: int) -> list[int]:
    """A monic polynomial of degree m irreducible over GF(p), as its m+1 coefficients
    (lowest first): the first with no root and no factor of lower degree, found by trial
    division (q is small: a factor has a handful of levels)."""
    if m == 1:
        return [0, 1]
    for low in itertools.product(range(p), repeat=m):
        poly = [*low, 1]
        if all(_remainder(poly, [*d, 1], p) for e in range(1, m // 2 + 1)
               for d in itertools.product(range(p), repeat=e)):
            return poly
    raise AssertionError(f"no irreducible polynomial of degree {m} over GF({p})")


def _remainder(poly: list[int], divisor: list[int], p: int) -> bool:
    """Whether the monic ``divisor`` leaves a non-zero remainder on ``poly`` (mod p)."""
    rest = list(poly)
    for top in range(len(rest) - 1, len(divisor) - 2, -1):
        c = rest[top]
        if c:
            for i, d in enumerate(divisor):
                rest[top - len(divisor) + 1 + i] = (rest[top - len(divisor) + 1 + i] - c * d) % p
    return any(rest[: len(divisor) - 1])
