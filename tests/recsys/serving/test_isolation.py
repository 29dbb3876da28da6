"""The serving runtime needs neither TorchRec nor FBGEMM nor torch.distributed; neither do ``recsys
predict`` and ``recsys export``, and a damaged bundle is refused before torch or the readers load."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import grimp
import pytest

from tests.conftest import ROOT, subprocess_env
from tests.recsys.serving.conftest import writable_copy

# The commands that make and use bundles read checkpoints and datasets, which need TorchRec.
TOOLS = {"commands", "evaluate", "export", "export_tiered", "predict", "runs"}
FORBIDDEN = ("torchrec", "fbgemm_gpu", "torch.distributed")

# Makes importing TorchRec or FBGEMM raise in the process that runs it first.
BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocked())
    """
)

# `recsys ARGS...` with TorchRec blocked; prints the exit code and the heavy modules it loaded.
CLI = BLOCKER + textwrap.dedent(
    """
    from recsys.cli import main

    code = main(sys.argv[1:])
    heavy = ("torchrec", "fbgemm_gpu", "torch", "numpy", "lmdb", "pyarrow")
    loaded = [m for m in sys.modules if m.split(".")[0] in heavy or m.startswith("recsys.data.")]
    print(code, sorted(m.split(".")[0] for m in loaded if m.split(".")[0] in heavy[:2]))
    print(sorted({m.split(".")[0] if not m.startswith("recsys") else m for m in loaded}))
    """
)

SCRIPT = BLOCKER + textwrap.dedent(
    """
    import numpy as np
    from recsys.serving import load_bundle

    scorer = load_bundle(sys.argv[1], cache_rows=10)
    dense = np.zeros((3, scorer.num_dense), np.float32)
    print(scorer(dense, {f: np.array([0, 5, 17]) for f in scorer.features}).tolist())
    print(sorted(m for m in sys.modules if m.split(".")[0] in ("torchrec", "fbgemm_gpu")))
    """
)


def test_load_bundle_scores_with_torchrec_and_fbgemm_blocked(exported):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(exported("table_wise_2"))],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    probs, loaded = proc.stdout.strip().splitlines()
    assert len(eval(probs)) == 3 and loaded == "[]"


def run_blocked(*args: str) -> subprocess.CompletedProcess:
    """``recsys ARGS...`` in a process where importing TorchRec or FBGEMM raises (see :data:`CLI`)."""
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_export_and_predict_run_with_torchrec_and_fbgemm_blocked(trained, tmp_path):
    bundle, out = tmp_path / "bundle", tmp_path / "scores.csv"
    proc = run_blocked("export", "--run", str(trained("table_wise_2")), "--out", str(bundle))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2] == "0 []", proc.stdout
    proc = run_blocked(
        "predict", "--bundle", str(bundle), "--out", str(out), "--split", "all", "--rows", "600"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2] == "0 []", proc.stdout
    assert len(out.read_text().splitlines()) == 601


def test_a_damaged_bundle_is_refused_in_one_line_before_torch_or_the_readers_load(exported, tmp_path):
    bundle = writable_copy(exported("table_wise_2"), tmp_path / "bundle")
    data = bytearray((bundle / "dense.safetensors").read_bytes())
    data[-5] ^= 0xFF  # one flipped byte among the weights
    (bundle / "dense.safetensors").write_bytes(bytes(data))
    proc = run_blocked("predict", "--bundle", str(bundle), "--out", str(tmp_path / "s.csv"))
    assert proc.returncode == 0, proc.stderr[-3000:]  # the script's own exit; main's code is printed
    code, loaded = proc.stdout.splitlines()[-2:]
    assert code == "2 []" and loaded == "[]", proc.stdout  # no torch, numpy, lmdb or reader was imported
    assert proc.stderr.strip().splitlines() == [
        f"recsys: error: bundle {bundle}: dense.safetensors is altered (checksum mismatch)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def _runtime_modules(graph: grimp.ImportGraph) -> list[str]:
    return sorted(m for m in graph.find_children("recsys.serving") if m.rsplit(".", 1)[1] not in TOOLS) + [
        "recsys.serving"
    ]


@pytest.mark.parametrize("forbidden", FORBIDDEN)
def test_no_runtime_module_imports_them_even_indirectly(forbidden):
    """import-linter's contract covers torchrec and fbgemm_gpu; it cannot name torch.distributed (a
    subpackage of an external package), so the import lines themselves are checked here."""
    graph = grimp.build_graph("recsys", "embedding_store", "pipelines", include_external_packages=True)
    runtime = _runtime_modules(graph)
    reached = set(runtime)
    for module in runtime:
        reached |= {
            m
            for m in graph.find_upstream_modules(module)
            if m.split(".")[0] in ("recsys", "embedding_store", "pipelines")
        }
    top = forbidden.split(".")[0]
    offenders = []
    for module in sorted(reached):
        if not graph.direct_import_exists(importer=module, imported=top):
            continue
        for detail in graph.get_import_details(importer=module, imported=top):
            line = detail["line_contents"]
            if forbidden == top or f"{forbidden}" in line:
                offenders.append(f"{module}:{detail['line_number']}: {line}")
    assert not offenders, offenders
