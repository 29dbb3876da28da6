"""``recsys predict`` writes one score per held-out row; their AUC is the checkpoint's AUC."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from recsys.errors import UserError
from recsys.metrics import auc_logloss
from recsys.serving.predict import predict
from recsys.serving.score_file import ScoreFile
from tests.recsys.serving.conftest import cli, summary


def _read_csv(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return rows


def test_predict_cli_scores_every_held_out_row(trained, exported, tmp_path):
    run = trained("table_wise_2")
    out = tmp_path / "scores.csv"
    args = ["predict", "--bundle", str(exported("table_wise_2")), "--out", str(out), "--batch-size", "100"]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scored 512 rows; cache hit rates: cat_0" in proc.stdout
    rows = _read_csv(out)
    assert [int(r["row"]) for r in rows] == list(range(512))
    logits = torch.tensor([float(r["logit"]) for r in rows], dtype=torch.float32)
    labels = torch.tensor([float(r["label"]) for r in rows])
    scores = torch.tensor([float(r["score"]) for r in rows], dtype=torch.float32)
    # sigmoid's vectorised and scalar paths may differ in the last bit: batches of 100 here, 512 there.
    torch.testing.assert_close(scores, torch.sigmoid(logits), rtol=3e-7, atol=0)
    # Other batches than the 2 ranks x 256 of training: AUC equal (no two scores swap order here),
    # log loss equal to float32 rounding of the logits (~1e-7 relative).
    auc, logloss = auc_logloss(logits, labels)
    saved = summary(run)
    assert auc == pytest.approx(saved["auc"], abs=1e-9)
    assert logloss == pytest.approx(saved["logloss"], rel=1e-6)


def test_predict_parquet_all_splits_with_a_row_limit(exported, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "scores.parquet"
    report = predict(exported("row_wise_2"), out, split="all", options={"rows": 700, "batch_size": 256})
    table = pq.read_table(out).to_pydict()
    assert report["rows"] == 700 and len(table["row"]) == 700
    splits = np.array(table["split"])
    assert (splits[:700] == "train").all()  # the training split first; synthetic training data is endless
    assert table["row"] == list(range(700))
    assert set(table) == {"row", "split", "label", "logit", "score"}


def test_predict_makes_a_missing_output_folder_or_refuses_in_one_line(exported, tmp_path):
    out = tmp_path / "new" / "folder" / "scores.csv"
    report = predict(exported("table_wise_2"), out, options={"rows": 10})
    assert report["rows"] == 10 and len(_read_csv(out)) == 10
    (tmp_path / "a_file").write_text("")
    proc = cli(
        "predict", "--bundle", str(exported("table_wise_2")), "--out", str(tmp_path / "a_file" / "s.csv")
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"recsys: error: --out {tmp_path / 'a_file' / 's.csv'}: cannot make its folder {tmp_path / 'a_file'}: "
        "File exists"
    ]


def test_predict_on_other_data_with_the_same_schema(exported, tmp_path):
    """``--set`` reshapes the data (here: a held-out split of another size) but not the model."""
    out = tmp_path / "s.csv"
    report = predict(exported("dcn_1"), out, options={"overrides": ["synthetic.eval_samples=100"]})
    assert report["rows"] == 100 and len(_read_csv(out)) == 100
    with pytest.raises(UserError, match="the model was trained on"):
        predict(exported("dcn_1"), tmp_path / "t.csv", options={"overrides": ["synthetic.num_sparse=3"]})
    with pytest.raises(UserError, match="no end"):
        predict(exported("dcn_1"), tmp_path / "t.csv", split="train")
    with pytest.raises(UserError, match="suffix"):
        predict(exported("dcn_1"), tmp_path / "t.txt")
    assert not (tmp_path / "t.csv").exists()


# -- a CSV dataset: provenance, key columns, data without labels ----------------------------------

# Features whose names do not sort in the model's order (z, a, m); a chronological split (order_by),
# so the held-out rows are not in file order; `request` is a key column no feature reads.
SHOP_SPEC = """name = "shop"
format = "csv"
[source]
files = ["clicks.csv"]
[read]
delimiter = ","
[label]
column = "click"
[split]
eval_fraction = 0.25
order_by = "ts"
[[dense]]
name = "age"
transform = "log1p"
[[dense]]
name = "price"
invalid = "missing"
[[sparse]]
name = "z"
column = "tags"
separator = "|"
[[sparse]]
name = "a"
column = "user"
kind = "int"
id_space = 300
[[sparse]]
name = "m"
column = "zip"
"""

SHOP_ROWS = 800


def _shop_lines(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = ["request,ts,user,tags,zip,age,price,click"]
    for i in range(n):
        tags = "|".join(f"t{rng.integers(0, 30)}" for _ in range(rng.integers(0, 4)))
        user = int(rng.integers(0, 300))
        price = "" if rng.random() < 0.1 else f"{rng.random() * 40:.2f}"
        click = int(rng.random() < 0.2 + 0.5 * (user % 3 == 0))
        ts = int(rng.integers(0, 10**6))  # not in file order: the split sorts the rows
        out.append(
            f"q{i:04d},{ts},{user},{tags},{rng.integers(100, 140)},{rng.integers(0, 90)},{price},{click}"
        )
    return out


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    """A run trained and exported on the CSV data: (root, run, bundle)."""
    from recsys.serving.export import export_bundle
    from tests.conftest import subprocess_env
    from tests.recsys.tiny import run_train, tiny_config

    root = tmp_path_factory.mktemp("shop")
    (root / "clicks.csv").write_text("\n".join(_shop_lines(SHOP_ROWS)) + "\n")
    (root / "spec.toml").write_text(SHOP_SPEC)
    data = {"source": str(root / "spec.toml")}
    config = tiny_config(data=data, train={"nproc": 1, "steps": 20}, store={"tables": ["z", "m"]})
    (root / "c.toml").write_text(config)
    run_train(root / "c.toml", root / "run", env=subprocess_env())
    export_bundle(root / "run", root / "bundle")
    return root, root / "run", root / "bundle"


def _file_rows(path):
    """{1-based line: the row as csv.DictReader gives it} of a CSV file (the header is line 1)."""
    with open(path, newline="") as f:
        return {i + 2: row for i, row in enumerate(csv.DictReader(f))}


def test_predict_auc_equals_evaluate_and_sorted_rows_map_back_to_their_lines(shop, tmp_path):
    from recsys.serving.evaluate import evaluate_checkpoint

    root, run, bundle = shop
    out = tmp_path / "s.csv"
    proc = cli(
        "predict", "--bundle", str(bundle), "--out", str(out), "--keep", "request,ts", "--batch-size", "50"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _read_csv(out)
    assert list(rows[0]) == ["file", "line", "request", "ts", "label", "logit", "score"]
    held = SHOP_ROWS // 4
    assert len(rows) == held
    # The oracle is the file: each output row's line holds its keys and its label.
    lines = _file_rows(root / "clicks.csv")
    for r in rows:
        line = lines[int(r["line"])]
        assert r["file"] == "clicks.csv"
        assert (r["request"], r["ts"], float(r["label"])) == (
            line["request"],
            line["ts"],
            float(line["click"]),
        )
    # They are the held-out rows of the chronological split: the latest quarter, in time order.
    ts = sorted(int(row["ts"]) for row in lines.values())
    assert [int(r["ts"]) for r in rows] == ts[-held:]
    logits = torch.tensor([float(r["logit"]) for r in rows], dtype=torch.float32)
    labels = torch.tensor([float(r["label"]) for r in rows])
    auc, logloss = auc_logloss(logits, labels)
    evaluated = evaluate_checkpoint(run)[0]
    assert auc == pytest.approx(evaluated["auc"], abs=1e-6)
    assert logloss == pytest.approx(evaluated["logloss"], rel=1e-5)


def test_predict_input_without_its_label_column_scores_every_row(shop, tmp_path):
    root, run, bundle = shop
    lines = _shop_lines(SHOP_ROWS)
    header = lines[0].split(",")
    order = [header.index(c) for c in ("price", "zip", "request", "age", "tags", "user", "ts")]  # no click
    new = tmp_path / "new.csv"
    new.write_text("\n".join(",".join(line.split(",")[i] for i in order) for line in lines) + "\n")
    out = tmp_path / "s.parquet"
    pq = pytest.importorskip("pyarrow.parquet")
    proc = cli(
        "predict", "--bundle", str(bundle), "--input", str(new), "--keep", "request", "--out", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pq.read_table(out).to_pydict()
    assert list(table) == ["file", "line", "request", "logit", "score"]  # no label: the file has none
    assert table["file"] == ["new.csv"] * SHOP_ROWS
    assert table["line"] == list(range(2, SHOP_ROWS + 2))
    assert table["request"] == [f"q{i:04d}" for i in range(SHOP_ROWS)]
    # The same rows with their label, read from the training file, score the same.
    labelled = tmp_path / "l.csv"
    report = predict(bundle, labelled, inputs=[root / "clicks.csv"], keep=["request"])
    assert report["rows"] == SHOP_ROWS
    rows = _read_csv(labelled)
    assert [r["request"] for r in rows] == table["request"] and "label" in rows[0]
    np.testing.assert_array_equal(np.array([float(r["logit"]) for r in rows], np.float32), table["logit"])


def test_predict_skipping_bad_rows_keeps_every_other_rows_key_and_line(shop, tmp_path):
    root, run, bundle = shop
    lines = _shop_lines(300, seed=5)
    bad = {7, 8, 120, 299}  # data rows made malformed: too few fields, a bad number, a bad id, too many
    lines[7] = "q_bad,1,2"
    lines[8] = lines[8].rsplit(",", 3)[0] + ",x1,3.5,1"  # age not a number
    fields = lines[120].split(",")
    lines[120] = ",".join([*fields[:2], "-4", *fields[3:]])  # a user id outside its id space
    lines[299] = lines[299] + ",extra"
    data = tmp_path / "bad.csv"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "s.csv"
    args = ["--input", str(data), "--keep", "request", "--set", "data.on_error=skip", "--batch-size", "32"]
    proc = cli("predict", "--bundle", str(bundle), "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _read_csv(out)
    expected = [i + 1 for i in range(1, len(lines)) if i not in bad]  # 1-based lines of the good rows
    assert [int(r["line"]) for r in rows] == expected
    for r in rows:  # the oracle: the file itself
        assert lines[int(r["line"]) - 1].split(",")[0] == r["request"]


def test_predict_refuses_what_it_cannot_do_in_one_line_and_leaves_no_file(shop, tmp_path):
    root, run, bundle = shop
    (root / "all.toml").write_text(SHOP_SPEC.replace("eval_fraction = 0.25", "eval_fraction = 0.0"))
    out = tmp_path / "s.csv"
    cases = [
        (["--data", str(root / "all.toml")], "no rows to score: the eval split is empty"),
        (["--keep", "request,nope"], "--keep nope: no such column in the data"),
        (["--keep", "score"], "--keep score: predict writes a column of that name itself"),
        (["--input", str(tmp_path / "missing.csv")], "input file not found"),
        (["--input", str(root / "clicks.csv"), "--split", "eval"], "takes no --split"),
    ]
    for args, message in cases:
        proc = cli("predict", "--bundle", str(bundle), "--out", str(out), *args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "--split" in proc.stderr or args[0] != "--data"
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    proc = cli(
        "predict",
        "--bundle",
        str(bundle),
        "--out",
        str(out),
        "--data",
        str(root / "all.toml"),
        "--split",
        "all",
    )
    assert proc.returncode == 0 and len(_read_csv(out)) == SHOP_ROWS


@pytest.mark.parametrize("where", ["open", "write", "score", "interrupt", "close"])
def test_a_failed_predict_leaves_no_file_behind(shop, tmp_path, monkeypatch, where):
    import recsys.serving.score_file as mod
    from recsys.serving.scorer import Scorer

    root, run, bundle = shop
    boom = KeyboardInterrupt() if where == "interrupt" else OSError(f"injected failure in {where}")
    calls = {"n": 0}

    def fail(*args, **kwargs):
        raise boom

    def fail_on_second(original):
        def wrapped(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise boom
            return original(self, *args, **kwargs)

        return wrapped

    if where == "open":  # the temporary file exists, then writing its header fails
        original_open = ScoreFile._open

        def open_then_fail(self):
            original_open(self)
            raise boom

        monkeypatch.setattr(ScoreFile, "_open", open_then_fail)
    elif where == "write":
        monkeypatch.setattr(ScoreFile, "write", fail_on_second(ScoreFile.write))
    elif where in ("score", "interrupt"):
        monkeypatch.setattr(Scorer, "logits", fail_on_second(Scorer.logits))
    else:
        monkeypatch.setattr(mod.os, "replace", fail)
    for out in (tmp_path / "s.csv", tmp_path / "s.parquet"):
        calls["n"] = 0
        with pytest.raises(type(boom)):
            predict(bundle, out, split="all", options={"batch_size": 64})
        assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_predict_reads_csv_with_torchrec_blocked(shop, tmp_path):
    from tests.recsys.serving.test_isolation import run_blocked

    root, run, bundle = shop
    out = tmp_path / "s.csv"
    proc = run_blocked(
        "predict", "--bundle", str(bundle), "--out", str(out), "--keep", "request", "--split", "all"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2] == "0 []", proc.stdout
    assert len(_read_csv(out)) == SHOP_ROWS


def _write_csv(path, header, rows):
    path.write_text("\n".join([",".join(header)] + [",".join(map(str, r)) for r in rows]) + "\n")


def test_recommend_keeps_the_top_k_of_every_user_as_predict_scores_them(shop, tmp_path):
    _, _, bundle = shop
    rng = np.random.default_rng(5)
    users = [(int(u), int(rng.integers(100, 140)), int(rng.integers(0, 90))) for u in (3, 17, 150, 299, 42)]
    items = []
    for i in range(36):
        tags = "|".join(f"t{rng.integers(0, 30)}" for _ in range(rng.integers(0, 4)))
        price = "" if i % 9 == 0 else f"{rng.random() * 40:.2f}"
        items.append((100 - i, tags, price))
    items.append((1000, items[0][1], items[0][2]))  # the same features as item 100
    _write_csv(tmp_path / "users.csv", ["user", "zip", "age"], users)
    _write_csv(tmp_path / "items.csv", ["item", "tags", "price"], items)
    out = tmp_path / "top.csv"
    proc = cli(
        "recommend", "--bundle", str(bundle), "--users", str(tmp_path / "users.csv"),
        "--candidates", str(tmp_path / "items.csv"), "--k", "5", "--out", str(out), "--batch-size", "37",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scored 185 pairs (5 users x 37 candidates)" in proc.stdout
    top = _read_csv(out)
    assert [r["rank"] for r in top] == ["1", "2", "3", "4", "5"] * 5

    # the oracle: every pair as a line of a file that predict scores, one user per batch of 37
    pairs = [(u, z, a, t, p) for (u, z, a) in users for (_, t, p) in items]
    _write_csv(tmp_path / "pairs.csv", ["user", "zip", "age", "tags", "price"], pairs)
    scored = tmp_path / "pairs_scores.csv"
    proc = cli(
        "predict", "--bundle", str(bundle), "--input", str(tmp_path / "pairs.csv"), "--out", str(scored),
        "--batch-size", "37",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _read_csv(scored)
    for n, (user, *_) in enumerate(users):
        mine = rows[n * 37 : (n + 1) * 37]
        ranked = sorted(range(37), key=lambda i: (-float(mine[i]["logit"]), items[i][0]))[:5]
        got = [r for r in top if r["user"] == str(user)]
        assert [r["item"] for r in got] == [str(items[i][0]) for i in ranked]
        assert [(r["logit"], r["score"]) for r in got] == [
            (mine[i]["logit"], mine[i]["score"]) for i in ranked
        ]
    # every candidate ranked (k above their number), best first
    everything = tmp_path / "all.csv"
    proc = cli(
        "recommend", "--bundle", str(bundle), "--users", str(tmp_path / "users.csv"),
        "--candidates", str(tmp_path / "items.csv"), "--k", "50", "--out", str(everything),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranked_all = _read_csv(everything)
    assert len(ranked_all) == 5 * 37
    for user, *_ in users:
        mine = [r for r in ranked_all if r["user"] == str(user)]
        assert sorted(r["item"] for r in mine) == sorted(str(i[0]) for i in items)
        assert all(float(a["logit"]) >= float(b["logit"]) for a, b in zip(mine, mine[1:], strict=False))


@pytest.mark.parametrize(
    ("users", "items", "message"),
    [
        (
            ["user,zip", "3,120"],
            ["item,tags,price", "1,t1,2.0"],
            "field 'age' (column 'age') is in neither file",
        ),
        (
            ["user,zip,age,price", "3,120,5,1"],
            ["item,tags,price", "1,t1,2.0"],
            "field 'price' (column 'price') is in both files",
        ),
        (["user,zip,age"], ["item,tags,price", "1,t1,2.0"], "no rows after the header"),
    ],
)
def test_recommend_refuses_bad_files_in_one_line(shop, tmp_path, users, items, message):
    _, _, bundle = shop
    (tmp_path / "u.csv").write_text("\n".join(users) + "\n")
    (tmp_path / "i.csv").write_text("\n".join(items) + "\n")
    proc = cli(
        "recommend", "--bundle", str(bundle), "--users", str(tmp_path / "u.csv"),
        "--candidates", str(tmp_path / "i.csv"), "--out", str(tmp_path / "o.csv"),
    )  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert message in line and line.startswith("recsys: error: ")
    assert not (tmp_path / "o.csv").exists()


def test_recommend_breaks_ties_by_item_key():
    from recsys.serving.recommend import _sort_keys, top_k

    logits = np.array([0.5, 0.9, 0.5, 0.5, 0.1], dtype=np.float32)
    numeric = _sort_keys(["10", "7", "9", "100", "1"])  # as integers: 9 < 10 < 100
    assert top_k(logits, numeric, 4).tolist() == [1, 2, 0, 3]
    text = _sort_keys(["b10", "x", "b9", "a", "z"])  # as text: a < b10 < b9
    assert top_k(logits, text, 5).tolist() == [1, 3, 0, 2, 4]
