"""A bundle is checked before it serves: incomplete, altered or foreign bundles are one-line errors."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from recsys.serving import BundleError, load_bundle
from recsys.serving.bundle import FILES, read_bundle
from recsys.serving.cache import open_rows
from tests.recsys.serving.conftest import cli, writable_copy


@pytest.fixture
def bundle(exported, tmp_path):
    return writable_copy(exported("table_wise_2"), tmp_path / "bundle")


def _flip_byte(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _manifest(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def test_a_complete_bundle_reads(bundle):
    assert read_bundle(bundle).features[0].name == "cat_0"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: (b / "tiered" / "data.mdb").unlink(), "incomplete: tiered/data.mdb is missing"),
        (lambda b: (b / "manifest.json").unlink(), "incomplete: manifest.json is missing"),
        (
            lambda b: _flip_byte(b / "dense.safetensors", -3),
            "dense.safetensors is altered (checksum mismatch)",
        ),
        (
            lambda b: _flip_byte(b / "tiered" / "data.mdb", 5000),
            "tiered/data.mdb is altered (checksum mismatch)",
        ),
        (
            lambda b: (b / "tables.safetensors").write_bytes((b / "tables.safetensors").read_bytes()[:-8]),
            "tables.safetensors is truncated or altered",
        ),
        (lambda b: (b / "notes.txt").write_text("hi"), "notes.txt is not listed in manifest.json"),
        (lambda b: (b / "manifest.json").write_text("{"), "manifest.json is not JSON"),
        (
            lambda b: (b / "manifest.json").write_text(json.dumps({**_manifest(b), "version": 1})),
            "format version 1, but this tierrec reads versions 2, 3; export the checkpoint again",
        ),
        (
            lambda b: (b / "manifest.json").write_text(
                json.dumps({**_manifest(b), "files": {**_manifest(b)["files"], "../x": {"bytes": 1}}})
            ),
            "lists '../x', which is not a bundle file",
        ),
    ],
    ids=[
        "no-tiered",
        "no-manifest",
        "dense-byte",
        "lmdb-byte",
        "truncated",
        "unlisted",
        "bad-json",
        "version",
        "outside",
    ],
)
def test_a_damaged_bundle_is_one_line(bundle, damage, message):
    damage(bundle)
    with pytest.raises(BundleError) as err:
        load_bundle(bundle)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_sizes_are_checked_without_checksums(bundle):
    _flip_byte(bundle / "dense.safetensors", -3)
    read_bundle(bundle, verify=False)  # same size: only a checksum sees it
    (bundle / "model.json").write_text((bundle / "model.json").read_text() + " ")
    with pytest.raises(BundleError, match="model.json is truncated or altered"):
        read_bundle(bundle, verify=False)


def test_predict_on_a_damaged_bundle_exits_2_with_one_line(bundle, tmp_path):
    _flip_byte(bundle / "dense.safetensors", -3)
    args = [
        "predict",
        "--bundle",
        str(bundle),
        "--out",
        str(tmp_path / "s.csv"),
    ]
    proc = cli(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"recsys: error: bundle {bundle}: dense.safetensors is altered (checksum mismatch)"
    ]
    assert not (tmp_path / "s.csv").exists()


def _rewrite_model(bundle, change):
    """Alter model.json and re-hash it in the manifest, as a hand edit that keeps the checksums would."""
    from recsys.serving.bundle import describe_files

    model = json.loads((bundle / "model.json").read_text())
    change(model)
    (bundle / "model.json").write_text(json.dumps(model))
    manifest = _manifest(bundle)
    manifest["files"].update(describe_files(bundle, ["model.json"]))
    (bundle / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.pop("interaction_order"),
        lambda m: m.update(interaction_order=m["interaction_order"][:-1]),
        lambda m: m.update(interaction_order=m["interaction_order"][:-1] + m["interaction_order"][:1]),
    ],
    ids=["missing", "short", "repeated"],
)
def test_a_bundle_without_a_true_interaction_order_is_refused(bundle, change):
    _rewrite_model(bundle, change)
    with pytest.raises(BundleError, match="export the checkpoint again") as err:
        read_bundle(bundle)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("precision", "version", "message"),
    [
        ("bf16", 3, "weights_precision 'bf16' is not one this tierrec reads"),
        ("fp16", 2, "weights_precision 'fp16' is not one this tierrec reads"),  # version 2 is fp32 only
        ("fp16", 3, "row_floats 8 do not fit 8 fp16 weights"),  # an fp32 bundle relabelled
    ],
)
def test_a_bundle_whose_precision_does_not_fit_is_refused(bundle, precision, version, message):
    _rewrite_model(bundle, lambda m: m.update(weights_precision=precision))
    (bundle / "manifest.json").write_text(json.dumps({**_manifest(bundle), "version": version}))
    with pytest.raises(BundleError) as err:
        load_bundle(bundle)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_version_2_bundle_reads_as_fp32(bundle):
    _rewrite_model(bundle, lambda m: m.pop("weights_precision"))
    (bundle / "manifest.json").write_text(json.dumps({**_manifest(bundle), "version": 2}))
    assert read_bundle(bundle).weights_precision.value == "fp32"
    load_bundle(bundle)


def test_the_scorer_stacks_features_in_the_recorded_order(bundle):
    """Features listed in another order in model.json are served in the interaction order."""
    _rewrite_model(bundle, lambda m: m.update(features=m["features"][::-1]))
    order = json.loads((bundle / "model.json").read_text())["interaction_order"]
    assert [f.name for f in read_bundle(bundle).features] == order


def test_no_pickle_anywhere_in_a_bundle(exported):
    """Every file is JSON, safetensors or LMDB, and the format names exactly these files."""
    for name in ("table_wise_2", "dcn_1"):
        bundle = exported(name, keep_optimizer_state=True, buffer_rows=300)
        files = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())
        assert files == sorted(["manifest.json", *FILES])
        for path in (bundle / "manifest.json", bundle / "model.json"):
            json.loads(path.read_text())
        for path in (bundle / "dense.safetensors", bundle / "tables.safetensors"):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open's keys() is a method
                    assert f.get_tensor(key).dtype.is_floating_point
        model = json.loads((bundle / "model.json").read_text())
        tiered = [f for f in model["features"] if f["kind"] == "tiered"]
        reader = open_rows(
            bundle / "tiered", tables=[f["table"] for f in tiered], row_floats=model["row_floats"]
        )
        for f in tiered:  # raw float32 rows, as many as model.json counts
            assert sum(ids.shape[0] for ids, _ in reader.scan(f["table"])) == f["rows"] > 0
        for path in bundle.rglob("*"):
            if path.is_file():
                head = path.read_bytes()[:2]
                assert head[:1] != b"\x80" and head != b"PK", path  # a pickle, or a torch.save zip
