"""Small dense linear algebra for least-squares fits of a few terms, without numpy: the
engine's chunk tuner and the operator's step fit each solve 2x2 or 3x3 systems."""

from __future__ import annotations


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (Gaussian elimination, partial pivoting); None if `a` is singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if m[pivot][col] == 0.0:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def determinant(a: list[list[float]]) -> float:
    """det(a) by cofactor expansion (for the few-term systems above)."""
    if len(a) == 1:
        return a[0][0]
    return sum(
        (-1) ** j * a[0][j] * determinant([row[:j] + row[j + 1 :] for row in a[1:]])
        for j in range(len(a))
    )
