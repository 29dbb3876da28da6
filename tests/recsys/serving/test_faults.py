"""Faults met by export, load_bundle and predict (issue 41): each is one line and exit 2 at the CLI (a
signal: 128 + its number), and leaves no half-written bundle or output behind.

- a full filesystem under the bundle or the output (a real tmpfs; needs root);
- a safetensors file whose header is malformed while its manifest entry matches;
- an LMDB of rows of another size, or of another row count (refused at load, not at the first lookup);
- a damaged LMDB meta page read with ``--no-verify``;
- a symbolic link in a bundle, to a file outside it or not;
- SIGINT and SIGTERM during export and predict (delivered for real, at a known moment);
- SIGKILL during export and predict: the next run to the same destination removes the leftovers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from recsys.errors import UserError
from recsys.serving import BundleError, load_bundle
from recsys.serving.bundle import describe_files
from recsys.serving.export import export_bundle
from tests.conftest import ROOT, needs_root, subprocess_env
from tests.recsys.serving.conftest import cli, writable_copy

RUN = "table_wise_2"

# Runs the CLI with one function wrapped to send this process a signal on its n-th call, just before the
# call runs: `driver.py module:Class.attr SIGNAL n -- recsys arguments...`.
DRIVER = """
import importlib, os, signal, sys

# Ctrl-C as in an interactive shell: a job started in the background (CI, nohup) inherits SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
target, signame, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
module, attr = target.split(":")
owner_name, name = attr.split(".")
owner = getattr(importlib.import_module(module), owner_name)
original = getattr(owner, name)
calls = [0]


def wrapped(*args, **kwargs):
    calls[0] += 1
    if calls[0] == n:
        os.kill(os.getpid(), getattr(signal, signame))
    return original(*args, **kwargs)


setattr(owner, name, wrapped)
from recsys.cli import main

sys.exit(main(sys.argv[5:]))
"""

APPEND = "recsys.serving.export:_TieredWriter.append"  # after dense and tables.safetensors are written
LOGITS = "recsys.serving.scorer:Scorer.logits"


def _signalled(tmp_path: Path, target: str, signame: str, n: int, *args: str) -> subprocess.CompletedProcess:
    """Run the driver; the result also has the process's ``pid`` (which names its temporaries)."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    command = [sys.executable, str(driver), target, signame, str(n), "--", *args]
    with subprocess.Popen(
        command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as popen:
        stdout, stderr = popen.communicate(timeout=300)
    done = subprocess.CompletedProcess(command, popen.returncode, stdout, stderr)
    done.pid = popen.pid  # type: ignore[attr-defined]
    return done


def _one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The error line of a refused command (the progress bar may precede it), which must be its only one."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "row/s]" not in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def _rehash(bundle: Path, name: str) -> None:
    """Record ``name``'s new size and checksum in the manifest, as an edit that keeps checksums would."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"].update(describe_files(bundle, [name]))
    (bundle / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def bundle(exported, tmp_path):
    return writable_copy(exported(RUN), tmp_path / "bundle")


# -- files that do not hold what the manifest says ----------------------------------------------------


def _bad_header(path: Path) -> None:
    """Give the first tensor of a safetensors file an unknown dtype, keeping the file's size."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = raw[8 : 8 + length]
    at = header.index(b'"F32"')
    path.write_bytes(raw[: 8 + at] + b'"Q32"' + raw[8 + at + 5 :])


@pytest.mark.parametrize("name", ["dense.safetensors", "tables.safetensors"])
def test_a_malformed_safetensors_header_is_one_line(bundle, tmp_path, name):
    _bad_header(bundle / name)
    with pytest.raises(BundleError, match=rf"{name} is not a readable safetensors file") as err:
        load_bundle(bundle, verify=False)  # the same size: only a checksum would see it
    assert "\n" not in str(err.value)
    _rehash(bundle, name)  # altered and re-hashed: the checksums match too
    with pytest.raises(BundleError, match=rf"{name} is not a readable safetensors file"):
        load_bundle(bundle)
    out = tmp_path / "s.csv"
    line = _one_line(cli("predict", "--bundle", str(bundle), "--out", str(out), "--no-verify"))
    assert line.startswith(f"recsys: error: bundle {bundle}: {name} is not a readable safetensors file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def _rewrite_rows(bundle: Path, change) -> None:
    """Rewrite every row of every tiered table through ``change(rows) -> rows`` (a list of (key, value))."""
    model = json.loads((bundle / "model.json").read_text())
    tables = [f["table"] for f in model["features"] if f["kind"] == "tiered"]
    env = lmdb.open(str(bundle / "tiered"), max_dbs=len(tables) + 1, lock=False, map_size=1 << 26)
    try:
        for table in tables:
            db = env.open_db(table.encode())
            with env.begin(write=True, db=db) as txn:
                rows = list(txn.cursor())
                txn.drop(db, delete=False)
                for key, value in change(rows):
                    txn.put(key, value)
    finally:
        env.close()
    _rehash(bundle, "tiered/data.mdb")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda rows: [(k, v + bytes(4)) for k, v in rows],
            r"holds rows of \d+ bytes \(9 floats\), model.json says 8",
        ),
        (
            lambda rows: [(k, v[:-4]) for k, v in rows],
            r"holds rows of \d+ bytes \(7 floats\), model.json says 8",
        ),
        (lambda rows: rows[1:], r"holds \d+ rows, model.json says \d+"),
    ],
    ids=["wider", "narrower", "a-row-less"],
)
def test_an_lmdb_of_another_models_rows_is_refused_at_load(bundle, change, message):
    _rewrite_rows(bundle, change)
    with pytest.raises(BundleError, match=message) as err:
        load_bundle(bundle)  # before, the first lookup of a stored id raised a ValueError
    assert "tiered/data.mdb: table t_cat_0" in str(err.value) and "\n" not in str(err.value)


def test_a_damaged_lmdb_meta_page_read_without_checksums_is_one_line(bundle, tmp_path):
    data = bytearray((bundle / "tiered" / "data.mdb").read_bytes())
    data[16:20] = data[4096 + 16 : 4096 + 20] = b"XXXX"  # both meta pages' magic
    (bundle / "tiered" / "data.mdb").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="tiered/data.mdb is not a readable LMDB environment"):
        load_bundle(bundle, verify=False)
    out = tmp_path / "s.csv"
    line = _one_line(cli("predict", "--bundle", str(bundle), "--out", str(out), "--no-verify"))
    assert line.startswith(f"recsys: error: bundle {bundle}: tiered/data.mdb is not a readable LMDB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


# -- symbolic links -----------------------------------------------------------------------------------


def _link_file_outside(bundle: Path) -> None:
    elsewhere = bundle.parent / "elsewhere"
    elsewhere.mkdir()
    (bundle / "tiered" / "data.mdb").rename(elsewhere / "data.mdb")
    (bundle / "tiered" / "data.mdb").symlink_to(elsewhere / "data.mdb")


def _link_folder_outside(bundle: Path) -> None:
    (bundle / "tiered").rename(bundle.parent / "elsewhere")
    (bundle / "tiered").symlink_to(bundle.parent / "elsewhere")


def _link_inside(bundle: Path) -> None:
    (bundle / "dense.safetensors").rename(bundle / "tiered" / "dense")
    (bundle / "dense.safetensors").symlink_to("tiered/dense")


@pytest.mark.parametrize(
    ("link", "message"),
    [
        (_link_file_outside, "tiered/data.mdb is a symbolic link (to {elsewhere}/data.mdb)"),
        (_link_folder_outside, "tiered is a symbolic link (to {elsewhere})"),
        (_link_inside, "dense.safetensors is a symbolic link (to tiered/dense)"),
    ],
    ids=["file-outside", "folder-outside", "inside"],
)
def test_a_bundle_never_serves_a_symbolic_link(bundle, tmp_path, link, message):
    link(bundle)
    expected = message.format(elsewhere=tmp_path / "elsewhere")
    for verify in (True, False):
        with pytest.raises(BundleError, match=re.escape(expected)) as err:
            load_bundle(bundle, verify=verify)
        assert "a bundle serves only files inside it" in str(err.value)
    out = tmp_path / "s.csv"
    line = _one_line(cli("predict", "--bundle", str(bundle), "--out", str(out)))
    assert line == f"recsys: error: bundle {bundle}: {expected}; a bundle serves only files inside it"
    assert not out.exists()


def test_a_bundle_through_a_symbolic_link_serves(exported, tmp_path):
    """The bundle's own folder may be reached through a link: only what is inside it is checked."""
    (tmp_path / "link").symlink_to(exported(RUN))
    assert load_bundle(tmp_path / "link").features


# -- a full filesystem --------------------------------------------------------------------------------


@needs_root
@pytest.mark.parametrize("fills", ["tables.safetensors", "tiered/data.mdb"])
def test_export_onto_a_full_filesystem_is_one_line_and_leaves_nothing(trained, exported, tmpfs, fills):
    whole = exported(RUN)
    before = (whole / "dense.safetensors").stat().st_size + 8192  # and the folders' entries
    tables = (whole / "tables.safetensors").stat().st_size
    room = before + (tables // 2 if fills == "tables.safetensors" else tables + 16384)
    mnt = tmpfs(f"{room // 1024}k")
    with pytest.raises(UserError) as err:
        export_bundle(trained(RUN), mnt / "b")
    assert (
        str(err.value) == f"no space left on device writing {mnt / 'b'}; free disk space, then export again"
    )
    cause = err.value.__cause__
    if fills == "tiered/data.mdb":  # LMDB reports the failed page write as EIO
        assert isinstance(cause, lmdb.Error) and "Input/output error" in str(cause), repr(cause)
    else:
        assert isinstance(cause, OSError) and cause.errno == 28, repr(cause)
    assert os.listdir(mnt) == []
    line = _one_line(cli("export", "--run", str(trained(RUN)), "--out", str(mnt / "b")))
    assert (
        line
        == f"recsys: error: no space left on device writing {mnt / 'b'}; free disk space, then export again"
    )
    assert os.listdir(mnt) == []


@needs_root
@pytest.mark.parametrize("name", ["s.csv", "s.parquet"])
def test_predict_onto_a_full_filesystem_is_one_line_and_leaves_nothing(exported, tmpfs, name):
    mnt = tmpfs("8k")
    out = mnt / name
    line = _one_line(cli("predict", "--bundle", str(exported(RUN)), "--out", str(out)))
    assert (
        line == f"recsys: error: no space left on device writing {out}; free disk space, then predict again"
    )
    assert os.listdir(mnt) == []


# -- signals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_during_export_is_one_line_and_leaves_no_bundle(trained, tmp_path, signame):
    out = tmp_path / "out" / "b"
    out.parent.mkdir()
    proc = _signalled(tmp_path, APPEND, signame, 1, "export", "--run", str(trained(RUN)), "--out", str(out))
    signum = getattr(signal, signame)
    line = _one_line(proc, 128 + signum)
    assert line == f"recsys: export stopped by {signame}; no bundle was written to {out}"
    assert os.listdir(out.parent) == []


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_during_predict_is_one_line_and_leaves_no_output(exported, tmp_path, signame):
    out = tmp_path / "out" / "s.csv"
    out.parent.mkdir()
    args = ["predict", "--bundle", str(exported(RUN)), "--out", str(out), "--batch-size", "64"]
    proc = _signalled(tmp_path, LOGITS, signame, 3, *args)
    line = _one_line(proc, 128 + getattr(signal, signame))
    assert line.startswith(f"recsys: predict stopped by {signame}; {out} was not written")
    assert os.listdir(out.parent) == []


def test_what_a_killed_export_left_is_removed_by_the_next(trained, tmp_path):
    out = tmp_path / "out" / "b"
    out.parent.mkdir()
    run = trained(RUN)
    proc = _signalled(tmp_path, APPEND, "SIGKILL", 2, "export", "--run", str(run), "--out", str(out))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    left = out.parent / f".b.tmp-{proc.pid}"
    assert os.listdir(out.parent) == [left.name] and (left / "tables.safetensors").is_file()
    live = out.parent / f".b.tmp-{os.getpid()}"  # a live process's temporary: not touched
    live.mkdir()
    again = cli("export", "--run", str(run), "--out", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(os.listdir(out.parent)) == sorted(["b", live.name])
    assert load_bundle(out).features


def test_what_a_killed_predict_left_is_removed_by_the_next(exported, tmp_path):
    out = tmp_path / "out" / "s.csv"
    out.parent.mkdir()
    args = ["predict", "--bundle", str(exported(RUN)), "--out", str(out), "--batch-size", "64"]
    proc = _signalled(tmp_path, LOGITS, "SIGKILL", 3, *args)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    left = out.parent / f".s.csv.tmp-{proc.pid}"
    assert os.listdir(out.parent) == [left.name]  # what the CSV writer had flushed, maybe nothing
    again = cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert os.listdir(out.parent) == ["s.csv"]
    assert len(out.read_text().splitlines()) == 513  # the header and every held-out row


def test_removing_leftovers_keeps_everything_else(tmp_path):
    from recsys.serving.output import remove_stale

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    names = [
        f".s.csv.tmp-{pid}",
        f".s.csv.tmp-{os.getpid()}",
        f".t.csv.tmp-{pid}",
        f".s.csv.tmp-{pid}x",
        "s.csv",
    ]
    for name in names:
        (tmp_path / name).write_text("x")
    assert remove_stale(tmp_path / "s.csv") == [tmp_path / names[0]]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
