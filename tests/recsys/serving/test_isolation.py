"""The serving runtime needs neither TorchRec nor FBGEMM nor torch.distributed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import grimp
import pytest

from tests.conftest import ROOT, subprocess_env

# The commands that make and use bundles read checkpoints and datasets, which need TorchRec.
TOOLS = {"commands", "evaluate", "export", "predict", "runs"}
FORBIDDEN = ("torchrec", "fbgemm_gpu", "torch.distributed")

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocked())
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
