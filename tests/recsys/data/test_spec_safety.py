"""Specs are untrusted data: every path they name stays inside its root, bad text gives one line.

Refused before anything is touched: absolute paths, ``..`` components, names that are not plain names;
after resolution: glob matches and symlinks that leave the root. Error messages never carry the contents
of a file outside the root.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from recsys.config import ConfigError, load_config
from recsys.data.source import DataConfig, build_dataset, check_source
from recsys.data.spec import load_spec, spec_from_dict
from recsys.data.synthetic import SyntheticConfig
from recsys.errors import UserError

SECRET = "root:x:0:0:SECRET-CONTENTS"
SHA = "0" * 64


def _tree(**source: object) -> dict:
    tree: dict = {
        "name": "clicks",
        "format": "csv",
        "source": {"files": ["clicks.csv"], **source},
        "read": {"delimiter": ","},
        "label": {"column": "click"},
        "sparse": [{"name": "user"}],
    }
    return tree


def _one_line_error(call) -> str:
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("change", "key", "value"),
    [
        ({"name": ".."}, "name", ".."),
        ({"name": "."}, "name", "."),
        ({"name": "a/b"}, "name", "a/b"),
        ({"name": "/tmp/x"}, "name", "/tmp/x"),
        ({"name": ""}, "name", ""),
        ({"name": "-rf"}, "name", "-rf"),
        ({"source": {"files": ["/etc/passwd"]}}, "[source] files", "/etc/passwd"),
        ({"source": {"files": ["../../etc/passwd"]}}, "[source] files", "../../etc/passwd"),
        ({"source": {"files": ["ok.csv", "a/../../x.csv"]}}, "[source] files", "a/../../x.csv"),
        ({"source": {"files": ["../*.csv"]}}, "[source] files", "../*.csv"),
        ({"source": {"files": ["a\\..\\..\\x"]}}, "[source] files", "a\\..\\..\\x"),
        ({"source": {"files": [""]}}, "[source] files", ""),
        ({"split": {"eval_files": ["/data/day_23"]}}, "[split] eval_files", "/data/day_23"),
        ({"split": {"eval_files": ["../day_23"]}}, "[split] eval_files", "../day_23"),
        ({"join": [{"file": "/etc/passwd", "on": "user"}]}, "[[join]] #1 file", "/etc/passwd"),
        ({"join": [{"file": "../users.csv", "on": "user"}]}, "[[join]] #1 file", "../users.csv"),
        ({"source": {"archive": "/tmp/x.whl"}}, "[source] archive", "/tmp/x.whl"),
        ({"source": {"archive": "../x.whl"}}, "[source] archive", "../x.whl"),
        ({"source": {"archive": "x.exe"}}, "[source] archive", "x.exe"),
        ({"source": {"member": "/etc"}}, "[source] member", "/etc"),
        ({"source": {"member": "pkg/../../.."}}, "[source] member", "pkg/../../.."),
        ({"source": {"package": "obp", "archive": "o.whl", "sha256": SHA}}, "[source] package", "obp"),
        ({"source": {"package": "obp==1 --index-url=x", "archive": "o.whl"}}, "[source] package", "obp"),
    ],
)
def test_each_path_key_refuses_escapes_with_one_line_naming_key_and_value(change, key, value):
    tree = _tree()
    for section, values in change.items():
        if isinstance(values, dict):
            tree[section] = {**tree.get(section, {}), **values}
        else:
            tree[section] = values
    message = _one_line_error(lambda: spec_from_dict(tree, path="my.toml"))
    assert message.startswith("my.toml") and key in message and repr(value)[1:-1] in message


def test_fetched_spec_needs_a_checksum_and_pip_args_are_refused():
    message = _one_line_error(
        lambda: spec_from_dict(_tree(package="obp==0.5.7", archive="obp-0.5.7.tar.gz"), path="s.toml")
    )
    assert "sha256" in message
    pip_args = ["--no-binary", ":all:"]
    message = _one_line_error(lambda: spec_from_dict(_tree(pip_args=pip_args), path="s.toml"))
    assert "pip_args is no longer supported" in message
    name = _tree(package="x==1", archive="x-1.whl", sha256=SHA)
    name["name"] = "downloads"
    assert "reserved" in _one_line_error(lambda: spec_from_dict(name, path="s.toml"))


def test_dotdot_name_with_absolute_archive_touches_nothing(tmp_path):
    """The reported bug: name = ".." made the fetcher rmtree a folder outside the cache."""
    sentinel = tmp_path / "precious"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("keep")
    cache = tmp_path / "cache" / "tierrec"
    spec = tmp_path / "evil.toml"
    spec.write_text(
        f'name = ".."\nformat = "csv"\n[source]\nfiles = ["keep.txt"]\npackage = "x==1"\n'
        f'archive = "{sentinel}/keep.whl"\nsha256 = "{SHA}"\n[label]\ncolumn = "c"\n'
        '[[sparse]]\nname = "u"\n'
    )
    config = DataConfig(source=str(spec), cache_dir=str(cache))
    message = _one_line_error(lambda: build_dataset(config, synthetic=SyntheticConfig(), seed=0))
    assert "name '..'" in message
    assert (sentinel / "keep.txt").read_text() == "keep"
    assert not (tmp_path / "cache").exists()  # refused before the cache was even created


def _csv_root(tmp_path: Path) -> tuple[Path, Path]:
    """A data root with one good CSV and an outside folder holding a file with a secret."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "clicks.csv").write_text("user,click\na,1\nb,0\nc,1\nd,0\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd.csv").write_text(f"{SECRET},click\n1,1\n")
    return root, outside


def _load_from(root: Path, tree: dict):
    spec = spec_from_dict(tree, path=str(root / "spec.toml"))
    from recsys.data.spec_dataset import SpecDataset

    return SpecDataset(spec, root=root, seed=0)


def test_files_inside_the_root_load(tmp_path):
    root, _ = _csv_root(tmp_path)
    os.symlink(root / "clicks.csv", root / "alias.csv")  # a symlink within the root is fine
    ds = _load_from(root, _tree(files=["alias.csv", "click*.csv"]))
    assert ds.train_source.num_rows() + ds.eval_source.num_rows() == 8


@pytest.mark.parametrize("entry", ["evil.csv", "*.csv", "sub/passwd.csv", "su?/passwd.csv"])
def test_symlink_or_glob_match_leaving_the_root_is_refused(tmp_path, entry):
    root, outside = _csv_root(tmp_path)
    os.symlink(outside / "passwd.csv", root / "evil.csv")
    os.symlink(outside, root / "sub")
    message = _one_line_error(lambda: _load_from(root, _tree(files=[entry])))
    assert "[source] files" in message and "outside" in message and "refused" in message
    assert "SECRET" not in message


def test_join_and_eval_files_leaving_the_root_are_refused(tmp_path):
    root, outside = _csv_root(tmp_path)
    os.symlink(outside / "passwd.csv", root / "users.csv")
    os.symlink(outside / "passwd.csv", root / "held.csv")
    tree = _tree()
    tree["join"] = [{"file": "users.csv", "on": "user"}]
    message = _one_line_error(lambda: _load_from(root, tree))
    assert "[[join]] #1 file" in message and "users.csv" in message and "SECRET" not in message
    tree = _tree()
    tree["split"] = {"eval_files": ["held.csv"]}
    message = _one_line_error(lambda: _load_from(root, tree))
    assert "[split] eval_files" in message and "SECRET" not in message


def test_recbole_side_file_and_npy_parts_leaving_the_root_are_refused(tmp_path):
    root, outside = _csv_root(tmp_path)
    (root / "ml.inter").write_text("user_id:token\trating:float\nu1\t5\n")
    os.symlink(outside / "passwd.csv", root / "ml.user")  # found automatically next to ml.inter
    tree = {
        "name": "ml",
        "format": "recbole",
        "source": {"files": ["ml.inter"]},
        "label": {"column": "rating", "threshold": 4.0},
        "sparse": [{"name": "user", "column": "user_id"}],
    }
    message = _one_line_error(lambda: _load_from(root, tree))
    assert "ml.user" in message and "outside" in message and "SECRET" not in message
    np.save(outside / "day_dense.npy", np.zeros((2, 1), np.float32))
    np.save(root / "day_sparse.npy", np.zeros((2, 1), np.int64))
    np.save(root / "day_labels.npy", np.zeros((2, 1), np.int32))
    os.symlink(outside / "day_dense.npy", root / "day_dense.npy")
    tree = {"name": "n", "format": "torchrec_npy", "source": {"files": ["day"]}}
    message = _one_line_error(lambda: _load_from(root, tree))
    assert "day_dense.npy" in message and "outside" in message


def test_spec_that_is_not_utf8_a_folder_or_missing_gives_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'name = "caf\xe9"\nformat = "csv"\n')
    assert _one_line_error(lambda: load_spec(bad)) == f"{bad}: not UTF-8 text (byte 0xe9 at offset 11)"
    assert "is a directory" in _one_line_error(lambda: load_spec(tmp_path))
    assert "not found" in _one_line_error(lambda: load_spec(tmp_path / "none.toml"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_spec_and_config_give_one_line(tmp_path):
    locked = tmp_path / "locked.toml"
    locked.write_text('name = "x"\n')
    locked.chmod(0)
    assert "Permission denied" in _one_line_error(lambda: load_spec(locked))
    assert "Permission denied" in _one_line_error(lambda: load_config(locked))


def test_config_that_is_not_utf8_or_a_folder_gives_one_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[train]\nsteps = 3\n# \xff\xfe\n")  # the 0xff is byte 20
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xff at offset 20\)$"):
        load_config(bad)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def _cli(repo_root, cli_env, python, *args):
    proc = subprocess.run(
        [python, "-m", "recsys", *args],
        cwd=repo_root,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stderr.strip().splitlines()


def test_cli_non_utf8_config_exits_2_with_one_line(tmp_path, repo_root, cli_env, python):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[train]\nsteps = 3 # \x80\n")
    code, lines = _cli(
        repo_root, cli_env, python, "train", "--config", str(bad), "--out", str(tmp_path / "o")
    )
    assert code == 2
    assert lines == [f"recsys: error: {bad}: not UTF-8 text (byte 0x80 at offset 20)"]


def test_cli_non_utf8_spec_exits_2_with_one_line(tmp_path, repo_root, cli_env, python):
    spec = tmp_path / "spec.toml"
    data = b'name = "x"\nformat = "csv" # \xc3\x28\n'  # 0xc3 starts a two-byte sequence, 0x28 is not one
    spec.write_bytes(data)
    code, lines = _cli(
        repo_root,
        cli_env,
        python,
        "train",
        "--config",
        str(repo_root / "configs/quickstart.toml"),
        "--out",
        str(tmp_path / "o"),
        "--set",
        f'data.source="{spec}"',
        "--set",
        "train.nproc=1",
    )
    message = f"{spec}: not UTF-8 text (byte 0xc3 at offset {data.index(0xC3)})"
    assert code == 2, lines
    assert lines == [f"recsys: error: {message}"]  # checked before any worker starts
    # What the CLI can call before it starts workers, so that the error is the only line.
    config = DataConfig(source=str(spec))
    assert _one_line_error(lambda: check_source(config)) == message


def test_a_field_whose_column_the_data_lacks_is_refused_before_any_worker_starts(tmp_path, cli_env):
    import subprocess
    import sys
    import time

    from tests.recsys.tiny import ROOT

    (tmp_path / "a.csv").write_text("user,item,price,y\n1,2,3.5,0\n2,3,1.0,1\n")
    (tmp_path / "side.csv").write_text("item,genre\n2,a\n3,b\n")
    spec = """name = "cols"
format = "csv"
[source]
files = ["a.csv"]
[read]
delimiter = ","
[label]
column = "y"
[[join]]
file = "side.csv"
on = "item"
[[dense]]
name = "AMOUNT"
[[sparse]]
name = "user"
[[sparse]]
name = "genre"
"""
    (tmp_path / "spec.toml").write_text(spec)
    (tmp_path / "c.toml").write_text(f'[data]\nsource = "{tmp_path / "spec.toml"}"\n[train]\nnproc = 2\n')
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "recsys", "train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "r")],
        cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"recsys: error: {tmp_path / 'spec.toml'}: no column 'AMOUNT' in a.csv or its [[join]] files "
        "(columns: user, item, price, y, genre)"
    ]
    assert "spawning" not in proc.stdout + proc.stderr  # found by the launcher, from the headers
    assert time.perf_counter() - started < 60
