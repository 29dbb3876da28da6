"""``exp`` and ``log`` in float64 that give the same bits on every CPU.

numpy's ``exp``, ``log``, ``log1p`` and ``power`` pick their kernels at run time: AVX-512 (SVML) kernels where
the CPU has them, the C library elsewhere. Both are accurate to about an ulp, and they differ in the last bit
for some inputs. A synthetic stream built on them is then another stream on another CPU: at 2**63 ids a rank
near 1e18 has an ulp of hundreds, so one bit moves the id (docs/reliability.md, "The same seed on every
CPU").

These functions use only operations whose results IEEE 754 fixes exactly, whatever the kernel: + - * /,
``floor``/``rint``, and the exact scalings ``frexp``/``ldexp``, each a separate numpy operation (so nothing can be
fused into an FMA), with the polynomials evaluated in a fixed order. They follow fdlibm's ``e_log.c`` and
``e_exp.c`` (the coefficients are fdlibm's; error below one ulp), vectorised. They are for data generation,
not for hot paths: about 10x slower than numpy's kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["exp", "log", "log1p", "power"]

_LN2_HI = 6.93147180369123816490e-01  # ln 2's upper 32 bits: k * _LN2_HI is exact for |k| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_SQRT_HALF = 0.70710678118654752440
_CHUNK = 1 << 14  # elements per piece: the temporaries of a piece fit in L2

_LG = (  # log: the minimax polynomial of (log((1 + s) / (1 - s)) - 2 s) / s in s**2 (fdlibm Lg1..Lg7)
    6.666666666666735130e-01,
    3.999999999940941908e-01,
    2.857142874366239149e-01,
    2.222219843214978396e-01,
    1.818357216161805012e-01,
    1.531383769920937332e-01,
    1.479819860511658591e-01,
)
_P = (  # exp: the minimax polynomial of r (e**r + 1) / (e**r - 1) - 2 in r**2 (fdlibm P1..P5)
    1.66666666666666019037e-01,
    -2.77777777770155933842e-03,
    6.61375632143793436117e-05,
    -1.65339022054652515390e-06,
    4.13813679705723846039e-08,
)
# exp overflows above log(DBL_MAX) and is 0 below log of the smallest subnormal.
_EXP_MAX = 709.782712893383973096
_EXP_MIN = -745.13321910194110842


def log(x: np.ndarray | float) -> np.ndarray:
    """Natural log of positive finite ``x`` (float64, any shape), the same bits on every CPU."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x) & (x > 0.0)):
        raise ValueError("portable log: arguments must be positive and finite")
    return _by_chunks(_log, x)


def _log(x: np.ndarray) -> np.ndarray:
    m, e = np.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    low = m < _SQRT_HALF
    m = np.where(low, m * 2.0, m)  # m in [sqrt(1/2), sqrt(2)): exact
    k = (e - low).astype(np.float64)
    f = m - 1.0  # exact (Sterbenz)
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (_LG[1] + w * (_LG[3] + w * _LG[5]))
    t2 = z * (_LG[0] + w * (_LG[2] + w * (_LG[4] + w * _LG[6])))
    r = t2 + t1
    hfsq = 0.5 * f * f
    return k * _LN2_HI - ((hfsq - (s * (hfsq + r) + k * _LN2_LO)) - f)


def exp(x: np.ndarray | float) -> np.ndarray:
    """``e ** x`` of finite ``x`` (float64, any shape), the same bits on every CPU; overflows to inf."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("portable exp: arguments must be finite")
    return _by_chunks(_exp, x)


def _exp(x: np.ndarray) -> np.ndarray:
    over, under = x > _EXP_MAX, x < _EXP_MIN
    x = np.clip(x, _EXP_MIN, _EXP_MAX)
    k = np.rint(x * _INV_LN2)  # |k| <= 1075
    hi = x - k * _LN2_HI
    lo = k * _LN2_LO
    r = hi - lo
    t = r * r
    c = r - t * (_P[0] + t * (_P[1] + t * (_P[2] + t * (_P[3] + t * _P[4]))))
    y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi)  # e**r, r in [-ln2/2, ln2/2]
    out = np.ldexp(y, k.astype(np.int32))  # exact scaling (rounded once where the result is subnormal)
    return np.where(over, np.inf, np.where(under, 0.0, out))


def power(base: np.ndarray | float, exponent: float) -> np.ndarray:
    """``base ** exponent`` for positive finite ``base`` as ``exp(exponent * log(base))``: the same bits on
    every CPU, with a relative error of about ``|exponent * log(base)|`` ulps."""
    return exp(exponent * log(base))


def log1p(x: np.ndarray | float) -> np.ndarray:
    """``log(1 + x)`` (float64, any shape), the same bits on every CPU, accurate for tiny ``x`` too (Kahan:
    ``log(u) * x / (u - 1)`` with ``u = 1 + x`` rounded, which cancels the rounding of ``u``; ``x`` itself
    where ``u`` rounds to 1). Like numpy's: NaN stays NaN, +inf stays +inf, -1 gives -inf, below -1 NaN."""
    x = np.asarray(x, dtype=np.float64)
    return _by_chunks(_log1p, x)


def _log1p(x: np.ndarray) -> np.ndarray:
    ok = np.isfinite(x) & (x > -1.0)
    xs = np.where(ok, x, 0.0)
    u = 1.0 + xs
    exact = u == 1.0  # x below half an ulp of 1: log1p(x) rounds to x
    safe = np.where(exact, 2.0, u)
    r = np.where(exact, xs, _log(safe) * (xs / (safe - 1.0)))
    return np.where(ok, r, np.where(x == -1.0, -np.inf, np.where(x < -1.0, np.nan, x)))


def _by_chunks(f: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """``f`` elementwise over ``x`` in pieces that stay in the CPU's cache (3x faster on large arrays)."""
    if x.size <= _CHUNK:
        return f(x)
    flat = x.reshape(-1)
    out = np.empty(flat.shape, dtype=np.float64)
    for lo in range(0, flat.size, _CHUNK):
        out[lo : lo + _CHUNK] = f(flat[lo : lo + _CHUNK])
    return out.reshape(x.shape)
