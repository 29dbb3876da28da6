"""Where pip would find a file: the package indexes pip is configured with, and their listings.

:func:`pip_indexes` reads pip's configuration (its config files and ``PIP_*`` variables, as pip ranks
them); :func:`archive_links` lists the places that advertise one archive of a project on those indexes
(PEP 503 HTML and PEP 691 JSON simple pages, and pip's find-links), which :func:`recsys.data.fetch.fetch`
then downloads and verifies. Credentials in the configured URLs go only to their own host.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

__all__ = ["PYPI", "PackageIndexes", "archive_links", "open_url", "pip_indexes", "redact"]

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
