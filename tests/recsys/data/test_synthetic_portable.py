"""The same seed gives the same synthetic stream on every CPU (issue 50).

Oracle: digests of the generator's output recorded once, compared in child processes whose numpy CPU
dispatch is limited (``NPY_DISABLE_CPU_FEATURES``) to each level this machine offers. numpy picks the kernels
of ``exp``/``log``/``power`` and of reductions by those levels, so a generator that used them would hash
differently at some level on an AVX-512 machine (the second test shows that the limit is real here).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from recsys.data import portable_math
from recsys.data.synthetic import SyntheticCriteo
from tests.conftest import ROOT


def stream_digest(data: SyntheticCriteo, steps: list[int], batch_size: int, split: str = "train") -> str:
    """sha256 (16 hex digits) of the dense values, labels, ids and lengths of the given steps."""
    h = hashlib.sha256()
    for step in steps:
        block = data.sample_block(
            np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.uint64), split=split
        )
        h.update(block.dense.tobytes())
        h.update(block.labels.tobytes())
        for jagged in block.ids:
            h.update(jagged.values.tobytes())
            h.update(jagged.lengths.tobytes())
    return h.hexdigest()[:16]


# (config, seed, steps, batch size, split, digest). Recorded once with the portable generator (see
# CHANGELOG, issue 50); the 2**63-id config is the one whose stream used to change on AVX2-only CPUs.
RECORDED: list[tuple[dict, int, list[int], int, str, str]] = [
    ({}, 0, [0, 1, 7], 512, "train", "5987de407c124f37"),
    (
        {"num_sparse": 3, "multi_hot": 3, "id_space": 2**63},
        5,
        [0, 1000, 123456],
        256,
        "train",
        "bd7ce90699cb95e1",
    ),
    ({"num_sparse": 2, "zipf_alpha": 1.0}, 1, [3], 300, "eval", "60199e126fc2fb9f"),
    (
        {"num_sparse": 4, "zipf_alpha": 0.8, "id_space": 2**40, "drift_ranks_per_sample": 0.37},
        2,
        [9, 5000],
        128,
        "train",
        "0549b745929bd90b",
    ),
]

# The readers' dense transform (log1p of counts and of real values), recorded the same way.
RECORDED_DENSE = "85c11b5b650bdb09"


def dense_transform_digest() -> str:
    """sha256 (16 hex digits) of the Criteo and tabular dense transforms of fixed counts and values."""
    from recsys.data.criteo import log_counts

    counts = np.arange(-5, 200_000, 7, dtype=np.int64)
    values = np.random.default_rng(7).lognormal(0.0, 4.0, 50_000)  # tiny to huge, fixed by the seed
    h = hashlib.sha256(log_counts(counts).tobytes())
    h.update(portable_math.log1p(values).tobytes())
    return h.hexdigest()[:16]


_CHILD = """
import json, sys
from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo
from tests.recsys.data.test_synthetic_portable import RECORDED, dense_transform_digest, stream_digest
from numpy._core import _multiarray_umath as m
active = [k for k in m.__cpu_dispatch__ if m.__cpu_features__.get(k)]
digests = [stream_digest(SyntheticCriteo(SyntheticConfig(**c), seed=s), st, b, sp) for c, s, st, b, sp, _ in RECORDED]
print(json.dumps({"active": active, "digests": digests, "dense": dense_transform_digest()}))
"""


def _dispatch_levels() -> list[list[str]]:
    """The sets of numpy dispatch targets to disable: none, then each found target and all above it."""
    from numpy._core import _multiarray_umath as m

    found = [k for k in m.__cpu_dispatch__ if m.__cpu_features__.get(k)]
    return [found[i:] for i in range(len(found) + 1)]


def _run_child(code: str, disabled: list[str]) -> dict:
    env = dict(os.environ, NPY_DISABLE_CPU_FEATURES=" ".join(disabled))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_stream_is_the_recorded_one_at_every_numpy_dispatch_level():
    levels = _dispatch_levels()
    for disabled in levels:
        result = _run_child(_CHILD, disabled)
        assert not set(result["active"]) & set(disabled), (disabled, result["active"])  # the limit took
        limit = f"NPY_DISABLE_CPU_FEATURES={' '.join(disabled)!r}"
        assert result["digests"] == [r[-1] for r in RECORDED], limit
        assert result["dense"] == RECORDED_DENSE, limit


_NUMPY_KERNELS = """
import hashlib, json
import numpy as np
x = np.random.default_rng(0).uniform(1e-3, 1e3, 1 << 16)
h = hashlib.sha256()
for f in (np.log, np.exp, np.log1p, lambda v: v ** 0.7):
    h.update(f(np.clip(x, -700, 700)).tobytes())
print(json.dumps({"digest": h.hexdigest()}))
"""


def test_limiting_the_dispatch_changes_numpys_own_kernels_here():
    """The harness above is not vacuous: on a CPU with AVX-512, numpy's float64 exp/log/power give other
    bits once AVX-512 is disabled, which is what moved the old generator's stream."""
    levels = _dispatch_levels()
    if not any(name.startswith(("X86_V4", "AVX512")) for name in levels[0]):
        pytest.skip(f"no AVX-512 dispatch on this CPU (found {levels[0]})")
    full = _run_child(_NUMPY_KERNELS, [])
    lowest = _run_child(_NUMPY_KERNELS, levels[0])
    assert full["digest"] != lowest["digest"]


@pytest.mark.parametrize("name", ["log", "exp"])
def test_portable_math_is_within_one_ulp_of_the_c_library(name):
    rng = np.random.default_rng(1)
    if name == "log":
        x = np.concatenate(
            [rng.uniform(1e-300, 1.0, 20_000), 2.0 ** rng.uniform(-1000, 1000, 20_000), [1.0, 2.0]]
        )
        got, ref = portable_math.log(x), np.array([math.log(v) for v in x])
    else:
        x = np.concatenate([rng.uniform(-700.0, 709.0, 20_000), rng.uniform(-1.0, 1.0, 20_000), [0.0]])
        got, ref = portable_math.exp(x), np.array([math.exp(v) for v in x])
    ulps = np.abs(got - ref) / np.spacing(np.abs(ref))
    assert ulps.max() <= 1.0
    assert (got == ref).mean() > 0.9  # correctly rounded almost everywhere


def test_portable_log1p_is_within_two_ulps_and_keeps_numpys_special_values():
    rng = np.random.default_rng(2)
    x = np.concatenate(
        [rng.uniform(-0.999, 1.0, 20_000), 10 ** rng.uniform(-300, 300, 20_000), [1e-17, 5e-324]]
    )
    got, ref = portable_math.log1p(x), np.array([math.log1p(v) for v in x])
    assert (np.abs(got - ref) / np.spacing(np.abs(ref))).max() <= 2.0
    special = np.array([0.0, -0.0, -1.0, -2.0, np.inf, np.nan])
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.log1p(special)
    assert np.array_equal(portable_math.log1p(special), expected, equal_nan=True)
    assert np.signbit(portable_math.log1p(-0.0))
    counts = np.arange(0, 100_000, dtype=np.float64)  # what the Criteo transform feeds it
    assert np.array_equal(portable_math.log1p(counts).astype(np.float32), np.log1p(counts).astype(np.float32))


def test_portable_math_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="positive"):
        portable_math.log(np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="finite"):
        portable_math.exp(np.array([np.nan]))
    assert portable_math.exp(np.array([800.0, -800.0])).tolist() == [math.inf, 0.0]
