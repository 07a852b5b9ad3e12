"""Datasets the notebooks use: downloaded, verified by hash, cached, turned into id tensors.

``fetch(name_or_url)`` takes a registry name (``"ml-100k"``, ``"text8"``, ...), a Google Drive
link or file id, or a plain URL. A plain http(s) URL (every registry entry) downloads with the
standard library (urllib, streamed, with a progress bar where tqdm is installed); a Google
Drive link with gdown (5.2 as on Colab, or 6.x; the ``[notebook]`` extra), imported only then.
Either way the file goes into a temporary directory beside the cache, failures are retried
with exponential backoff, size and hash are checked, and only then is the file renamed into
the cache (on Google Drive in Colab, so that a new runtime does not download it again). A
cached file with pinned hashes is hashed again each time it is used, and downloaded again when
it no longer matches. Drive's "too many users have viewed or downloaded this file" quota error
gets its own message with the workaround.

Loaders turn files into what the models eat: ``load_movielens`` / ``load_ratings`` ->
``Ratings(user_ids, item_ids, ratings, num_users, num_items, timestamps)`` with ids renumbered
0..n-1 (MovieLens of every size, Goodbooks, any ``user,item,rating[,timestamp]`` CSV, RecBole
``.inter`` files),
``load_text8`` -> ``Corpus(ids, vocab, counts)``. Small bundled samples (``"movielens-sample"``,
``"text8-sample"``) need no network: the notebooks' smoke settings and CI use them.
The word-vector evaluation sets (``"ws353"``, ``"simlex999"``, ``"questions-words"``, fetched
from gensim's repository) have bundled made-up samples too (``"ws353-sample"``, ...).

>>> r = load("movielens-sample")
>>> r.num_users, r.num_items, r.user_ids.dtype
(300, 200, torch.int64)
>>> c = load("text8-sample", min_count=1)
>>> c.ids.shape[0], len(c.vocab), int(c.counts[0]) == int(c.counts.max())
(30000, 66, True)
"""
from __future__ import annotations

import dataclasses
import difflib
import errno
import fnmatch
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import stat
import sys
import time
import warnings
import zipfile
import zlib
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from . import NbtoolsError
from .files import (UnsafeFileError, create_private, file_kind, make_folder, regular_or_refuse,
                    write_private)

SAMPLES_DIR = Path(__file__).parent / "datasets"


class DownloadError(NbtoolsError, ConnectionError):
    """A download failed after its retries (or for a reason retrying cannot fix)."""


class HashMismatchError(NbtoolsError, ValueError):
    """The downloaded file is not the expected one."""


class DriveQuotaError(NbtoolsError, RuntimeError):
    """Google Drive refuses the download for now: too many people fetched the file."""


class DatasetNotFoundError(NbtoolsError, FileNotFoundError):
    """``load`` got neither a registry name nor an existing path."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A registry entry. ``md5``/``sha256``/``bytes`` are None where no published value is known:
    the file is then checked against the hashes computed on its first download (kept beside it
    in the cache), and ``fetch`` prints them so that you can pin them."""

    name: str
    url: str | None               # None: bundled with nbtools (no download)
    filename: str
    kind: str                     # "ratings", "text", "wordsim" (word pairs) or "analogy"
    description: str
    md5: str | None = None
    sha256: str | None = None
    bytes: int | None = None
    hash_source: str = ""


_ML = "https://files.grouplens.org/datasets/movielens"
_GL = "md5 published by GroupLens beside the file (.zip.md5)"
# gensim's test data at its 4.4.0 tag (commit ee2642b4fa26e689ba4595067504668bc7a89016). No
# hash is published; these are the same files' hashes in the gensim 4.4.0 wheel on PyPI
# (gensim/test/test_data/), checked equal to the tag's blobs.
_GENSIM = "https://raw.githubusercontent.com/piskvorky/gensim/4.4.0/gensim/test/test_data"
_GS = ("md5, sha256 and size of the file in the gensim 4.4.0 wheel on PyPI, the same bytes as "
       "at the repository's tag 4.4.0")
REGISTRY: dict[str, Dataset] = {d.name: d for d in [
    Dataset("ml-100k", f"{_ML}/ml-100k.zip", "ml-100k.zip", "ratings",
            "MovieLens 100K: 100,000 ratings, 943 users, 1,682 movies",
            md5="0e33842e24a9c977be4e0107933c0723",
            sha256="50d2a982c66986937beb9ffb3aa76efe955bf3d5c6b761f4e3a7cd717c6a3229",
            bytes=4_924_029, hash_source=_GL + "; sha256 and size as recorded by several users"),
    Dataset("ml-1m", f"{_ML}/ml-1m.zip", "ml-1m.zip", "ratings",
            "MovieLens 1M: 1,000,209 ratings, 6,040 users, 3,706 movies",
            md5="c4d9eecfca2ab87c1945afe126590906",
            sha256="a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20",
            hash_source=_GL + "; sha256 as pinned by tensorflow/models"),
    Dataset("ml-10m", f"{_ML}/ml-10m.zip", "ml-10m.zip", "ratings",
            "MovieLens 10M: 10,000,054 ratings, 69,878 users, 10,677 movies",
            hash_source="none pinned here: checked against the first download"),
    Dataset("ml-20m", f"{_ML}/ml-20m.zip", "ml-20m.zip", "ratings",
            "MovieLens 20M: 20,000,263 ratings, 138,493 users, 26,744 movies",
            md5="cd245b17a1ae2cc31bb14903e1204af3",
            sha256="96f243c338a8665f6bcc89c53edf6ee39162a846940de6b7c8c48aeada765ff3",
            bytes=198_702_078, hash_source=_GL + "; sha256 and size as recorded by users"),
    Dataset("ml-25m", f"{_ML}/ml-25m.zip", "ml-25m.zip", "ratings",
            "MovieLens 25M: 25,000,095 ratings, 162,541 users, 59,047 movies",
            md5="6b51fb2759a8657d3bfcbfc42b592ada", bytes=261_978_986, hash_source=_GL),
    Dataset("ml-32m", f"{_ML}/ml-32m.zip", "ml-32m.zip", "ratings",
            "MovieLens 32M: 32,000,204 ratings, 200,948 users, 87,585 movies",
            hash_source="none pinned here: checked against the first download"),
    Dataset("ml-latest-small", f"{_ML}/ml-latest-small.zip", "ml-latest-small.zip", "ratings",
            "MovieLens latest-small: 100,836 ratings, 610 users, 9,742 movies (changes over time)",
            hash_source="none pinned here (GroupLens updates this file): checked against the "
                        "first download"),
    Dataset("goodbooks-10k",
            "https://raw.githubusercontent.com/zygmuntz/goodbooks-10k/master/ratings.csv",
            "goodbooks-10k-ratings.csv", "ratings",
            "Goodbooks-10k: ~6M ratings of 10,000 books by 53,424 users (CC BY-SA 4.0)",
            hash_source="none published: checked against the first download"),
    Dataset("text8", "https://mattmahoney.net/dc/text8.zip", "text8.zip", "text",
            "text8: the first 10^8 characters of cleaned English Wikipedia (~17M words)",
            md5="f26f94c5209bc6159618bad4a559ff81", bytes=31_344_016,
            hash_source="no hash published by the host; md5 as pinned by the Keras/TensorFlow "
                        "text8 loaders, size from the word2vec tutorials; no public record of "
                        "its sha256 was found, so md5 and size are both checked"),
    # word-vector evaluation sets (nbtools.models.wordsim): the files gensim ships in its test data
    Dataset("ws353", f"{_GENSIM}/wordsim353.tsv", "wordsim353.tsv", "wordsim",
            "WordSimilarity-353: 353 word pairs with human relatedness scores (Finkelstein et "
            "al., 2002)", md5="fa3334003a2c00a47810856c5813a990",
            sha256="f92a022fc2537793a15bc3a8c162ebcd74990e033a228bb6388cb71e4c0b1e1d",
            bytes=7_186, hash_source=_GS),
    Dataset("simlex999", f"{_GENSIM}/simlex999.txt", "simlex999.txt", "wordsim",
            "SimLex-999: 999 word pairs with human similarity scores (Hill et al., 2015)",
            md5="ea3b421726e288d9c368d3db0f1831a4",
            sha256="d5e0501971478a511430ee880bd0121e94ac701ba86d90544d83e6d2ba3db05d",
            bytes=18_126, hash_source=_GS),
    Dataset("questions-words", f"{_GENSIM}/questions-words.txt", "questions-words.txt", "analogy",
            "Google analogy questions: 19,544 'a b c d' questions in 14 sections (Mikolov et al., "
            "2013)", md5="8b7461cbf7ecc0aec9b32eb626821105",
            sha256="8c29b3332afc46f3fb8be04cb5297bf96f39aa7131272dff57869b4485b22a36",
            bytes=603_955, hash_source=_GS),
    Dataset("ws353-sample", None, "wordsim353-sample.tsv", "wordsim",
            "made-up WS353-format pairs of text8-sample's words, bundled (smoke runs, CI)"),
    Dataset("simlex999-sample", None, "simlex999-sample.txt", "wordsim",
            "made-up SimLex-format pairs of text8-sample's words, bundled (smoke runs, CI)"),
    Dataset("questions-words-sample", None, "questions-words-sample.txt", "analogy",
            "made-up analogy questions of text8-sample's words, bundled (smoke runs, CI)"),
    Dataset("movielens-sample", None, "ratings-sample.csv", "ratings",
            "synthetic MovieLens-format ratings with planted genres (make_ratings_sample), "
            "bundled with nbtools (smoke runs, CI)"),
    Dataset("text8-sample", None, "text8-sample.txt", "text",
            "synthetic text8-like corpus bundled with nbtools (smoke runs, CI)"),
]}

QUOTA_HELP = (
    "Google Drive refuses this download for now: too many users have viewed or downloaded the "
    "file recently (Drive's per-file quota). Workaround: open {link} in a browser while signed "
    "in, choose 'Make a copy' (File > Make a copy, or the copy icon) to put it in your own "
    "Drive, share the copy as 'Anyone with the link', and fetch the copy's id instead: "
    "nbtools.data.fetch('<id of your copy>', md5=...). Or wait up to 24 h and try again.")

_DRIVE_ID = re.compile(r"^[A-Za-z0-9_-]{25,}$")
_DRIVE_URL = re.compile(r"https?://(?:drive|docs)\.google\.com/.*?(?:/d/|[?&]id=)([A-Za-z0-9_-]{25,})")


def parse_source(s: str):
    """What :func:`fetch` makes of a source that is not a dataset name: ``("drive", id)`` for a
    Google Drive link, ``gdrive:<id>`` or bare file id, ``("url", url)`` for an http(s)/ftp URL;
    ValueError else. Drive links are parsed here: gdown 6 dropped fuzzy=."""
    m = _DRIVE_URL.match(s)
    if m:
        return "drive", m.group(1)
    if s.startswith("gdrive:"):
        return "drive", s[len("gdrive:"):]
    if _DRIVE_ID.match(s):
        return "drive", s
    if re.match(r"^(https?|ftp)://", s):
        return "url", s
    raise ValueError(f"fetch({s!r}): not a dataset name ({', '.join(REGISTRY)}), a URL, or a "
                     "Google Drive link or file id")


def default_cache_dir() -> Path:
    """``$NBTOOLS_DATA_DIR``, else Google Drive in Colab (survives a new runtime), else
    ``~/.cache/nbtools/datasets``."""
    env = os.environ.get("NBTOOLS_DATA_DIR")
    if env:
        return Path(env).expanduser()
    from .colab import drive_dir, in_colab

    if in_colab():
        return drive_dir("nbtools/datasets")
    return Path("~/.cache/nbtools/datasets").expanduser()


# --- files handed over by others: read only regular files, write nothing through a link -------
#
# A cache or dataset folder may come from anyone (a shared Drive folder, a lab server). Below
# the folder the user named, a symbolic link is refused (it could lead the read or the write
# anywhere), a FIFO or device is refused without blocking on it (opened O_NONBLOCK, checked with
# fstat), and what nbtools writes goes to a new name (O_EXCL | O_NOFOLLOW) renamed into place.
# What nbtools makes is its user's alone, as elsewhere in the package: folders 0700, files 0600.

def _what_is(path, mode: int) -> str:
    """``path``'s kind in words, from its lstat mode (a link's target named)."""
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link (to {os.readlink(path)!r})"
        except OSError:
            return "a symbolic link"
    return file_kind(mode)


def _open_regular(path, fix: str, follow_symlinks: bool = False) -> int:
    """A read descriptor of the regular file ``path``, blocking as usual. A symbolic link is
    refused (``O_NOFOLLOW``) unless ``follow_symlinks`` (the path the user named), and a FIFO,
    device, socket or folder is refused without blocking on it (opened ``O_NONBLOCK``, checked
    with ``fstat``). Raises :class:`UnsafeFileError` naming the file, with ``fix`` appended."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno != errno.ELOOP or follow_symlinks:
            raise
        raise UnsafeFileError(f"{path} is {_what_is(path, os.lstat(path).st_mode)}, not a "
                              f"regular file: nbtools does not read through links here. {fix}"
                              ) from None

    def refuse(mode):
        raise UnsafeFileError(f"{path} is {_what_is(path, mode)}, not a regular file: "
                              f"nothing was read from it. {fix}")
    return regular_or_refuse(fd, refuse)


def _real_folder(folder: Path) -> Path:
    """``folder`` (inside the cache root), made with mode 0700 where missing, checked with lstat
    to be a real folder: never a symbolic link, which could send downloads anywhere."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    mode = os.lstat(folder).st_mode
    if not stat.S_ISDIR(mode):
        raise UnsafeFileError(
            f"{folder} is {_what_is(folder, mode)}, where the data cache keeps a folder of its "
            "own: below the cache root nbtools follows no link (it could lead a download "
            f"anywhere), and nothing was written. Remove it (rm {folder}) and fetch again; to "
            "keep the cache on another disk, pass cache_dir= or set NBTOOLS_DATA_DIR there "
            "(the cache root itself may be a link).")
    return folder


def _check_name(name: str, what: str) -> str:
    """``name`` when it is one plain file or folder name (no separator, not ``.`` or ``..``)."""
    if not name or name in (".", "..") or "/" in name or "\0" in name or \
            (os.altsep and os.altsep in name):
        raise ValueError(f"fetch(): {what} {name!r} is not a plain file name (no '/', not '.' "
                         "or '..'); the cache keeps every file directly in its source's folder")
    return name


def file_hashes(path, chunk_bytes: int = 8 << 20, *, follow_symlinks: bool = False) -> dict:
    """``{"bytes", "md5", "sha256"}`` of a regular file, in one pass.

    A FIFO, device or folder raises :class:`UnsafeFileError` at once (instead of hashing
    forever or blocking), and so does a symbolic link unless ``follow_symlinks``."""
    md5, sha = hashlib.md5(), hashlib.sha256()
    n = 0
    fix = "Hash the regular file itself."
    with open(_open_regular(path, fix, follow_symlinks), "rb") as f:
        while block := f.read(chunk_bytes):
            md5.update(block)
            sha.update(block)
            n += len(block)
    return {"bytes": n, "md5": md5.hexdigest(), "sha256": sha.hexdigest()}


class _Retryable(Exception):
    """Internal: a failure worth another attempt."""


def _gdown_download(kind: str, source: str, output: str, quiet: bool) -> str:
    """One gdown call that behaves the same on gdown 5.2 and 6.x (raises, never returns None)."""
    import gdown   # lazy: only fetch() needs it

    kwargs = {"output": output, "quiet": quiet}
    if kind == "drive":
        result = gdown.download(id=source, **kwargs)
    else:
        result = gdown.download(url=source, use_cookies=False, **kwargs)
    if result is None:   # gdown < 6 reports some failures by returning None
        raise _Retryable("gdown returned no file (see its message above)")
    return result


def _url_download(source: str, output: str, quiet: bool) -> str:
    """An http(s) download with the standard library (no gdown needed): streamed to ``output``
    (a folder ending in os.sep: named from the URL), with a progress bar where tqdm is
    installed. Raises urllib's errors (HTTPError, URLError) and ``_Retryable`` for a body cut
    short."""
    import urllib.request

    req = urllib.request.Request(source, headers={"User-Agent": "nbtools"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        if output.endswith(os.sep):
            tail = resp.url.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
            output += re.sub(r"[^\w.-]", "_", tail).lstrip(".") or "download"
        total = int(resp.headers.get("Content-Length") or 0) or None
        bar = None
        if not quiet:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=total, unit="B", unit_scale=True, desc=Path(output).name,
                           file=sys.stderr)
            except ImportError:
                pass
        got = 0
        try:
            with open(create_private(output), "wb") as f:
                while True:
                    chunk = resp.read(1 << 20)
                    if not chunk:
                        break
                    f.write(chunk)
                    got += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
    if total is not None and got != total:
        raise _Retryable(f"the download stopped at {got:,} of {total:,} bytes")
    return output


def _require_downloader(what: str) -> None:
    """Raise an ImportError that names the install line when gdown (or requests, which it
    brings) is missing: Google Drive downloads need the ``[notebook]`` extra."""
    try:
        import gdown  # noqa: F401  (only whether it imports)
        import requests  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"downloading {what} from Google Drive needs gdown, which is not installed ({e}). "
            "Install it: %pip install gdown in a notebook cell (pip install gdown in a shell). "
            "A file already in the cache, or a local path, needs neither.") from e


def _looks_like_error_page(path: Path, expected_name: str) -> str | None:
    """gdown 5 saves an HTTP error body as if it were the file; spot HTML where none belongs."""
    if expected_name.lower().endswith((".html", ".htm")):
        return None
    with open(path, "rb") as f:
        head = f.read(4096)
    text = head.lstrip().lower()
    if text.startswith((b"<!doctype html", b"<html")) or b"<title>" in text[:512]:
        return head.decode("utf-8", "replace")
    return None


def _classify(e: BaseException, link: str):
    """-> the exception to raise now, or None when ``e`` is worth another attempt."""
    if "too many users" in str(e).lower():
        return DriveQuotaError(QUOTA_HELP.format(link=link))
    if isinstance(e, _Retryable):
        return None
    import urllib.error
    if isinstance(e, urllib.error.HTTPError):       # plain URLs (no gdown)
        if e.code >= 500 or e.code == 429:
            return None
        return DownloadError(f"{link}: the server answered HTTP {e.code}"
                             f"{' (not found)' if e.code == 404 else ''}; check the URL")
    if isinstance(e, (urllib.error.URLError, ConnectionError, TimeoutError)) or \
            type(e).__name__ == "IncompleteRead":
        return None
    try:
        import requests   # gdown depends on it (Drive links)
    except ImportError:
        return e
    if isinstance(e, requests.HTTPError):
        status = e.response.status_code if e.response is not None else None
        if status is not None and (status >= 500 or status == 429):
            return None
        return DownloadError(f"{link}: the server answered HTTP {status}"
                             f"{' (not found)' if status == 404 else ''}; check the URL")
    if isinstance(e, requests.RequestException):   # connection reset, timeout, cut-off body
        return None
    if type(e).__module__.startswith("gdown"):
        if type(e).__name__ == "FileURLRetrievalError":
            return DownloadError(f"Google Drive would not hand out {link}: {e}\nCheck that the "
                                 "file is shared as 'Anyone with the link'.")
        return None                                # gdown 6: "Download is incomplete", ...
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DownloadError(f"no space left on the cache disk for {link}: {e}")
    return e


@dataclasses.dataclass
class FetchConfig:
    """How :func:`fetch` downloads: where it caches, how it retries, how much it says."""

    cache_dir: object = None       # default: default_cache_dir() (Google Drive in Colab)
    # Further attempts after a network or server failure; the wait doubles each time,
    # starting at backoff_s seconds.
    retries: int = 3
    backoff_s: float = 2.0
    quiet: bool = False            # no progress output
    sleep: object = time.sleep     # injectable for tests


def fetch(name_or_url: str, *, md5: str | None = None, sha256: str | None = None,
          filename: str | None = None, config: FetchConfig | None = None, **options) -> Path:
    """Download (or find in the cache) a dataset file and return its local path.

    Args:
        name_or_url: a registry name (see ``REGISTRY``), a Google Drive link or file id, or an
            http(s) URL.
        md5, sha256: expected hashes (registry entries bring their own).
        filename: name in the cache (default: the registry's, the URL's, or Drive's).
        config: :class:`FetchConfig`; its fields can also be passed by name (``cache_dir=``,
            ``retries=``, ``backoff_s=``, ``quiet=``, ``sleep=``).

    The cache may be handed over by anyone (a shared Drive folder, a lab server), so below
    its root (which may itself be a link: to Drive, say) nothing is followed and only regular
    files are read. A source's folder that is a symbolic link or not a folder raises
    :class:`UnsafeFileError` (nothing is written; remove it). A cached file or sidecar that is
    a link, a FIFO, a device or a socket is a miss: never read (no hang, nothing read through a
    link), named in a warning, removed (the link itself, not its target) and downloaded again.
    Downloads and sidecars are written to new names (``O_EXCL | O_NOFOLLOW``) in a folder
    checked to be a real one and renamed into place, so a link planted at a name is replaced,
    never written through. What ``fetch`` makes is its user's alone, as elsewhere in nbtools:
    folders it creates (the cache root's missing ones included) have mode 0700, files 0600;
    existing folders keep theirs (``chmod`` a cache you mean to share).

    Raises:
        HashMismatchError: the file is not the expected one (it is deleted).
        DriveQuotaError: Drive's download quota; the message says how to get around it.
        DownloadError: still failing after the retries, or a failure retrying cannot fix.
        UnsafeFileError: the source's folder in the cache is a link or not a folder, or a
            folder stands where the cached file belongs.
        ValueError: ``filename`` is not a plain file name (a '/', or '.' or '..').
    """
    unknown = set(options) - {f.name for f in dataclasses.fields(FetchConfig)}
    if unknown:
        raise TypeError(f"fetch() got unexpected keyword argument(s) {sorted(unknown)}; it takes "
                        f"md5, sha256, filename, config and the FetchConfig fields "
                        f"{[f.name for f in dataclasses.fields(FetchConfig)]}")
    cfg = dataclasses.replace(config or FetchConfig(), **options)
    cache_dir, retries, backoff_s, quiet, sleep = (cfg.cache_dir, cfg.retries, cfg.backoff_s,
                                                   cfg.quiet, cfg.sleep)
    entry = REGISTRY.get(name_or_url)
    expected_bytes = None
    if entry is not None:
        if entry.url is None:
            return SAMPLES_DIR / entry.filename
        kind, source = parse_source(entry.url)
        md5, sha256 = md5 or entry.md5, sha256 or entry.sha256
        filename, expected_bytes, key = filename or entry.filename, entry.bytes, entry.name
    else:
        kind, source = parse_source(name_or_url)
        if kind == "drive":
            key = f"drive-{source}"
        else:
            key = "url-" + hashlib.sha1(source.encode()).hexdigest()[:12]
            tail = source.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
            filename = filename or re.sub(r"[^\w.-]", "_", tail).lstrip(".") or "download"
    link = f"https://drive.google.com/uc?id={source}" if kind == "drive" else source
    want = {k: v.lower() for k, v in (("md5", md5), ("sha256", sha256)) if v}

    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    make_folder(os.fspath(root))   # (missing ones 0700; the root may be a link the user made)
    folder = _real_folder(root / _check_name(key, "the source's cache folder"))
    if filename:
        _check_name(filename, "filename")
    hit = _cached(folder, filename, want, expected_bytes)
    if hit is not None:
        return hit

    if kind == "drive":       # gdown for Drive links only; plain URLs need the standard library
        _require_downloader(repr(name_or_url))      # before anything is tried: name the extra
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    say(f"fetching {name_or_url} from {link} -> {folder}")
    last = None
    for attempt in range(retries + 1):
        if attempt:
            wait = backoff_s * 2 ** (attempt - 1)
            say(f"  attempt {attempt} of {retries + 1} failed ({last}); retrying in {wait:.0f} s")
            sleep(wait)
        tmp = folder / f".fetch-{os.getpid()}-{time.time_ns():x}"
        os.mkdir(tmp, 0o700)
        try:
            download = _gdown_download if kind == "drive" else \
                (lambda _kind, *args: _url_download(*args))
            got_name = Path(download(kind, source, str(tmp / filename) if filename
                                     else str(tmp) + os.sep, quiet)).name
            out = tmp / _check_name(got_name, "the download's name")
            if not stat.S_ISREG(os.lstat(out).st_mode):
                raise DownloadError(f"{link}: the downloader left {out} as "
                                    f"{_what_is(out, os.lstat(out).st_mode)}, not a file")
            os.chmod(out, 0o600)              # gdown's file too: the user's alone
            page = _looks_like_error_page(out, filename or out.name)
            if page is not None:
                if "too many users" in page.lower():
                    raise DriveQuotaError(QUOTA_HELP.format(link=link))
                raise _Retryable(f"the server sent an HTML page instead of the file: "
                                 f"{' '.join(re.sub('<[^>]+>', ' ', page).split())[:160]!r}")
            got = file_hashes(out)
            if expected_bytes is not None and got["bytes"] != expected_bytes:
                raise _Retryable(f"got {got['bytes']:,} bytes, expected {expected_bytes:,} "
                                 "(interrupted download?)")
            for alg, value in want.items():
                if got[alg] != value:
                    raise HashMismatchError(
                        f"{link}: {alg} of the download is {got[alg]}, expected {value} "
                        f"({got['bytes']:,} bytes). The server now serves a different file, or "
                        "the expected hash is wrong; the file was deleted. Check the source, or "
                        f"pass {alg}=None to accept it.")
            final = _real_folder(folder) / (filename or out.name.lstrip(".") or "download")
            os.replace(out, final)     # replaces a link at the name, never writes through it
            _write_sidecar(final, got, link, verified=bool(want))
            if not want:
                say(f"  {final.name}: no published hash; recorded md5 {got['md5']} "
                    f"sha256 {got['sha256']} (pass them to fetch() to pin this file)")
            return final
        except (HashMismatchError, DriveQuotaError, UnsafeFileError):
            raise
        except Exception as e:
            verdict = _classify(e, link)
            if verdict is not None:
                raise verdict from e
            last = f"{type(e).__name__}: {e}".splitlines()[0][:300].rstrip(".")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise DownloadError(f"could not download {link} after {retries + 1} attempts; last error: "
                        f"{last}. Check the connection and the URL, or download the file yourself "
                        f"and put it at {folder / (filename or '<name>')}.")


def sidecar_path(path: Path) -> Path:
    """Where the data cache keeps what it checked of the cached file ``path`` (its size, mtime
    and hashes at the download), beside it as a hidden JSON file."""
    return path.with_name(f".{path.name}.nbtools.json")


def _write_sidecar(path: Path, hashes: dict, link: str, verified: bool) -> None:
    """The sidecar of the cached file ``path``: written to a new name (mode 0600, never through
    a link) and renamed over whatever was at the sidecar's name."""
    body = json.dumps({**hashes, "url": link, "verified": verified,
                       "mtime_ns": os.lstat(path).st_mtime_ns}).encode()
    side = sidecar_path(path)
    try:
        write_private(side, body)
    except UnsafeFileError as e:         # (a folder at the sidecar's name)
        raise UnsafeFileError(
            f"{side} is a folder, where the data cache keeps the record of {path.name!r} "
            f"(its hashes); the download itself is at {path}. Move or remove that folder "
            "and fetch again.") from e


_SIDECAR_MAX_BYTES = 1 << 16      # a sidecar is ~250 bytes: anything larger is not one


def _read_sidecar(path: Path):
    """The record beside the cached file ``path``: a dict, or None where there is none or it is
    not JSON. A sidecar that is not a regular file raises :class:`UnsafeFileError`."""
    try:
        fd = _open_regular(sidecar_path(path), "")
    except UnsafeFileError:
        raise
    except OSError:                    # none, or unreadable: no record
        return None
    with open(fd, "rb") as f:
        raw = f.read(_SIDECAR_MAX_BYTES + 1)
    try:
        meta = json.loads(raw) if len(raw) <= _SIDECAR_MAX_BYTES else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _cached(folder: Path, filename: str | None, want: dict,
            expected_bytes: int | None = None) -> Path | None:
    """A cached file that is complete (its sidecar is written only after the download's
    checks) and is the expected file, or None. A cached file that fails the checks is removed
    with its sidecar and named in a warning; :func:`fetch` then downloads it again.

    Where hashes are pinned (``want``: the caller's or the registry's; ``expected_bytes`` with
    them), the file is hashed again on every use, whatever its sidecar says: the sidecar is
    just another file in the cache, so a planted file beside a sidecar copied or forged to
    match would otherwise be used. That is one read of the file, md5 and sha256 together
    (:func:`file_hashes`), a fraction of a second for text8's 31 MB (figures in
    benchmarks/RESULTS.md).

    Where nothing is pinned, the hashes the sidecar recorded at the download are the
    reference, and the file is hashed again only when its size or mtime differ from the
    sidecar's: trust on first use. Whoever can write the cache can rewrite the sidecar too;
    pin the hashes (``fetch`` prints them at the first download) to close that.

    A download leaves regular files only, so a cached file or sidecar that is a symbolic link,
    a FIFO, a device or a socket is never read (no hang, nothing read through a link): it is a
    miss, named in a warning and removed (a link itself, never what it points to), and the new
    download is renamed into its place. A folder at the file's name cannot be replaced that
    way, and removing someone's folder is not the cache's to do: :class:`UnsafeFileError`.
    """
    names = [filename] if filename else sorted(p.name for p in folder.iterdir()
                                               if not p.name.startswith("."))
    for name in names:
        path = folder / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            if not filename:
                continue
            raise UnsafeFileError(
                f"{path} is a folder, where the data cache keeps the downloaded file {name!r}; "
                "nothing was written. Move or remove that folder and fetch again, or pass "
                "filename= another name.")
        bad = None if stat.S_ISREG(mode) else f"{path} is {_what_is(path, mode)}"
        try:
            meta = _read_sidecar(path)
        except UnsafeFileError:
            side = sidecar_path(path)
            meta, bad = {}, f"{side} is {_what_is(side, os.lstat(side).st_mode)}"
        if meta is None:
            continue
        if bad is not None:
            _drop(path, f"{bad}, where a download leaves a regular file: the cache was handed "
                        "over or altered by hand. Nothing was read from it or through it; "
                        f"removed {name} and its sidecar (a link itself, never what it points "
                        "to); fetching it again. To use a copy of your own, pass its path to "
                        "load().")
            continue
        st = os.lstat(path)
        if want:
            expected = dict(want, **({} if expected_bytes is None else {"bytes": expected_bytes}))
            source = "pinned"
        elif st.st_size == meta.get("bytes") and st.st_mtime_ns == meta.get("mtime_ns"):
            return path
        else:                                           # touched since: hash it again
            expected = {k: meta.get(k) for k in ("bytes", "md5", "sha256")}
            source = "recorded in its sidecar at the download"
        got = file_hashes(path)
        wrong = [k for k, v in expected.items() if got[k] != v]
        if not wrong:
            if not want and st.st_mtime_ns != meta.get("mtime_ns"):
                _write_sidecar(path, got, meta.get("url", ""), meta.get("verified", False))
            return path
        what = "; ".join(f"{k} is {got[k]}, expected {expected[k]}" for k in wrong)
        _drop(path, f"{path}: the cached file is not the expected one ({what}, {source}): it "
                    "was damaged or replaced after its download. Removed it and its sidecar; "
                    "fetching it again.")
    return None


def _drop(path: Path, message: str) -> None:
    """Warn ``message`` and remove the cached ``path`` and its sidecar (a link itself, never
    what it points to); a read-only cache keeps them, and the download's rename replaces them."""
    warnings.warn(message, stacklevel=4)
    for p in (path, sidecar_path(path)):
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass


# --- loaders ------------------------------------------------------------------------------------

class Ratings(NamedTuple):
    """Interactions with ids renumbered 0..n-1 (in the order of the original ids)."""

    user_ids: torch.Tensor        # int64 (N,)
    item_ids: torch.Tensor        # int64 (N,)
    ratings: torch.Tensor         # float32 (N,); 1.0 where the file has no rating column
    num_users: int
    num_items: int
    timestamps: torch.Tensor | None = None   # int64 (N,) seconds, where the file has them


class Corpus(NamedTuple):
    """A tokenised corpus: word ids (most frequent word = 0), the words, their counts."""

    ids: torch.Tensor             # int64 (tokens,)
    vocab: list
    counts: torch.Tensor          # int64 (len(vocab),)


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatch(name.rsplit("/", 1)[-1], pattern)


# What a zip member may expand to before it is refused (the loaders' max_member_bytes and
# max_member_ratio). The whole member is held in memory as bytes and parsed from there, so the
# cap is a memory bound: text8 unzips to 100,000,000 bytes, ml-20m's ratings.csv to ~533 MB.
# Text and ratings deflate a few to one (text8 3.2:1, the bundled samples 3-4.5:1) and deflate
# cannot pass ~1032:1, which a bomb of repeated bytes reaches: 100:1 leaves real files alone and
# stops such a bomb long before the cap. Members up to _RATIO_FREE_BYTES pass whatever their
# ratio: small repetitive files are real too, and hold little memory.
MAX_MEMBER_BYTES = 2 << 30
MAX_MEMBER_RATIO = 100.0
_RATIO_FREE_BYTES = 16 << 20


class ArchiveLimitError(NbtoolsError, ValueError):
    """An archive member or a plain file is larger than the loader's cap, or a member expands
    more than real data does."""


def _open_member(path: Path, candidates, max_bytes: int | None = MAX_MEMBER_BYTES,
                 max_ratio: float | None = MAX_MEMBER_RATIO):
    """Bytes of the first member named like one of ``candidates`` (names or glob patterns such
    as ``*.inter``; a zip or a directory), or the file itself, and its name.

    A zip member is read streaming under ``max_bytes`` and ``max_ratio`` (see
    :func:`_read_member`). A file in a directory, or the file itself, is read whole under
    ``max_bytes`` too (its size is what is on disk). Only regular files are read: a FIFO or
    device is refused without blocking on it, and inside a directory a symbolic link is
    refused as well (it could lead outside); ``path`` itself may be a link, the user named it.
    """
    if path.is_dir():
        for c in candidates:
            hits = sorted(path.rglob(c))      # (rglob does not descend into linked folders)
            if hits:
                fd = _open_regular(hits[0], (
                    f"A dataset folder holds regular files only. Replace {hits[0].name} with "
                    f"the file itself, or pass the path of the file you mean to load()."))
                with open(fd, "rb") as f:
                    return _read_capped(f, hits[0], max_bytes), hits[0].name
        raise FileNotFoundError(f"{path} holds none of {list(candidates)}")
    fd = _open_regular(path, "Pass the path of a regular file (a zip, a text or CSV file) or a "
                             "folder.", follow_symlinks=True)
    with open(fd, "rb") as f:
        if zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                infos = [i for i in z.infolist() if not i.is_dir()]
                pick = next((i for c in candidates for i in infos if _matches(i.filename, c)),
                            None)
                if pick is None and len(infos) == 1:
                    pick = infos[0]
                if pick is None:
                    raise FileNotFoundError(f"{path} holds none of {list(candidates)}: "
                                            f"{z.namelist()[:10]}")
                return (_read_member(z, pick, path, max_bytes, max_ratio),
                        pick.filename.rsplit("/", 1)[-1])
        f.seek(0)
        return _read_capped(f, path, max_bytes), path.name


def _read_capped(f, path: Path, max_bytes: int | None, chunk_bytes: int = 1 << 24) -> bytes:
    """The whole of the open regular file ``f``, refused before it is read when it is larger
    than ``max_bytes``, and while it is read when it goes on past it (None: no cap)."""
    how = ("The whole file is read into memory. If it is the file you meant to load and you "
           "have the memory, pass a larger max_member_bytes= (None for no limit) to load(), "
           "load_text8() or load_ratings().")
    size = os.fstat(f.fileno()).st_size
    if max_bytes is not None and size > max_bytes:
        raise ArchiveLimitError(f"{path} is {size:,} bytes, over the cap of {max_bytes:,} "
                                f"bytes. {how}")
    data = f.read(size)                 # what fstat said, in one read; then whatever grew
    rest = io.BytesIO()
    while chunk := f.read(chunk_bytes if max_bytes is None else
                          min(chunk_bytes, max_bytes + 1 - len(data) - rest.tell())):
        rest.write(chunk)
        if max_bytes is not None and len(data) + rest.tell() > max_bytes:
            raise ArchiveLimitError(f"{path} goes on past the cap of {max_bytes:,} bytes while "
                                    f"it is read (it said {size:,}); reading stopped. {how}")
    return data + rest.getvalue() if rest.tell() else data


def _read_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, archive: Path,
                 max_bytes: int | None, max_ratio: float | None,
                 chunk_bytes: int = 1 << 20) -> bytes:
    """One zip member's bytes, refused before it is read when its declared size is over
    ``max_bytes`` or its declared size over its compressed size is over ``max_ratio``, and
    refused while it is read when the bytes it actually produces pass the same limits
    (declared sizes are the archive's word, not a fact). None turns a limit off.

    Raises:
        ArchiveLimitError: over a limit; the message names the archive, the member, the limit
            and the argument that raises it.
        zipfile.BadZipFile: the member's data does not match the archive's directory.
    """
    where = f"{archive}: member {info.filename!r}"
    how = ("The whole member is read into memory. If the archive is the one you meant to load "
           "and you have the memory, pass a larger {arg}= (None for no limit) to load(), "
           "load_text8() or load_ratings().")
    ratio_cap = None if max_ratio is None else \
        max(_RATIO_FREE_BYTES, math.ceil(max_ratio * info.compress_size))
    if max_bytes is not None and info.file_size > max_bytes:
        raise ArchiveLimitError(
            f"{where} declares {info.file_size:,} bytes uncompressed, over the cap of "
            f"{max_bytes:,} bytes. " + how.format(arg="max_member_bytes"))
    if ratio_cap is not None and info.file_size > ratio_cap:
        raise ArchiveLimitError(
            f"{where} declares {info.file_size:,} bytes uncompressed from "
            f"{info.compress_size:,} compressed ({info.file_size / max(info.compress_size, 1):,.0f}"
            f":1), over the limit of {max_ratio:g}:1: text compresses a few to one (text8 3.2:1), "
            "a zip bomb of repeated bytes ~1000:1. " + how.format(arg="max_member_ratio"))
    limits = [c for c in (max_bytes, ratio_cap) if c is not None]
    limit = min(limits) if limits else None
    out = io.BytesIO()       # getvalue() hands over its buffer: no second copy of the member
    got = 0
    try:
        with z.open(info) as f:
            while True:
                want = chunk_bytes if limit is None else min(chunk_bytes, limit + 1 - got)
                chunk = f.read(want)
                if not chunk:
                    break
                got += len(chunk)
                if limit is not None and got > limit:
                    arg, what = (("max_member_bytes", "cap") if limit == max_bytes else
                                 ("max_member_ratio", "ratio limit"))
                    raise ArchiveLimitError(
                        f"{where} declares {info.file_size:,} bytes uncompressed but goes on past "
                        f"{limit:,} bytes (its {what}); reading stopped there. The archive's "
                        "directory understates the member: a damaged or hostile archive. "
                        + how.format(arg=arg))
                out.write(chunk)
    except (zipfile.BadZipFile, zlib.error) as e:
        raise zipfile.BadZipFile(
            f"{where}: {e}. Its data does not match the archive's directory (a damaged or "
            "altered archive). Delete the file (fetch() downloads it again) or repair it.") from e
    return out.getvalue()


def _table(data: bytes, delimiter: str, skip_header: bool, cols) -> np.ndarray:
    """Columns ``cols`` of a delimited numeric table as float64 (pandas when present: faster)."""
    try:
        import pandas as pd
    except ImportError:
        pd = None
    if pd is not None:
        df = pd.read_csv(io.BytesIO(data), sep=delimiter, header=None, usecols=list(cols),
                         skiprows=1 if skip_header else 0, engine="c", dtype=np.float64)
        return df[list(cols)].to_numpy()
    return np.loadtxt(io.BytesIO(data), delimiter=delimiter, skiprows=1 if skip_header else 0,
                      usecols=cols, dtype=np.float64, ndmin=2)


def _header_col(header, path, keys, required=True):
    """Index of the first header field containing one of ``keys`` (None if optional and absent)."""
    for i, h in enumerate(header):
        if any(k in h for k in keys):
            return i
    if required:
        raise ValueError(f"{path}: no column like {keys} in header {header}")
    return None


def _renumber(column) -> tuple[np.ndarray, int]:
    """Ids 0..n-1 in the order of the original ids (numeric order when they are numbers)."""
    try:
        column = np.asarray(column, dtype=np.float64).astype(np.int64)
    except ValueError:                       # RecBole tokens need not be numbers
        column = np.asarray(column, dtype=str)
    uniq, inverse = np.unique(column, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64), len(uniq)


def _read_inter(data: bytes, path) -> list:
    """RecBole atomic ``.inter`` file: a tab-separated header of ``name:type`` fields. Returns
    the user, item, rating (or None) and timestamp (or None) columns."""
    lines = data.decode("utf-8").splitlines()
    header = [h.split(":")[0].strip().lower() for h in lines[0].split("\t")]
    cols = [_header_col(header, path, ("user",)), _header_col(header, path, ("item",)),
            _header_col(header, path, ("rating", "score"), required=False),
            _header_col(header, path, ("timestamp",), required=False)]
    want = [c for c in cols if c is not None]
    try:
        table = _table(data, "\t", True, tuple(want))
        by_col = {c: table[:, j] for j, c in enumerate(want)}
    except ValueError:                       # string tokens: split by hand
        rows = [line.split("\t") for line in lines[1:] if line]
        by_col = {c: [r[c] for r in rows] for c in want}
    return [by_col[c] if c is not None else None for c in cols]


def _refuse_missing(name: str, columns: dict) -> None:
    """Refuse a numeric column with an empty or non-numeric field (read as NaN) or an infinite
    one, naming the data row: renumbered, a NaN id would become an id of its own, and a NaN
    rating would stop training at its first batch."""
    for what, col in columns.items():
        if col is None:
            continue
        try:
            values = np.asarray(col, dtype=np.float64)
        except ValueError:                   # RecBole tokens: ids need not be numbers
            continue
        bad = ~np.isfinite(values)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{name}: data row {row + 1:,} (counted from 1, header left out) "
                             f"has {what} {float(values[row])!r}: an empty, non-numeric or infinite "
                             f"field ({int(bad.sum()):,} such rows in all). Fix or drop those "
                             "rows in the file.")


def load_ratings(path, *, user_col="user", item_col="item", rating_col="rating",
                 max_member_bytes: int | None = MAX_MEMBER_BYTES,
                 max_member_ratio: float | None = MAX_MEMBER_RATIO) -> Ratings:
    """Load interactions from a zip, a directory or the file itself.

    Formats: MovieLens 100K ``u.data``, 1M/10M ``ratings.dat``, 20M/25M/32M/latest
    ``ratings.csv``, Goodbooks-10k or any CSV with a header, and RecBole ``.inter`` files
    (``user_id:token<TAB>item_id:token<TAB>rating:float<TAB>timestamp:float``). CSV columns are
    found by header names containing ``user_col``, ``item_col`` (also ``movie`` and ``book``),
    ``rating_col`` and ``timestamp`` (optional). Timestamps are kept where the file has them
    (temporal splits need them); a file without ratings gets 1.0 for every interaction.

    ``max_member_bytes`` and ``max_member_ratio`` bound what a zip member may expand to (it is
    read into memory whole), and ``max_member_bytes`` a plain file's size too: over either,
    :class:`ArchiveLimitError` says so; None turns one off. Only regular files are read: a FIFO
    or device raises :class:`UnsafeFileError` at once, and so does a symbolic link inside a
    directory (the path you pass may be a link).
    """
    path = Path(path)
    data, name = _open_member(path, ("ratings.csv", "ratings.dat", "u.data", "*.inter"),
                              max_member_bytes, max_member_ratio)
    if name == "u.data" or name.endswith(".dat"):
        table = _table(data.replace(b"::", b"\t"), "\t", False, (0, 1, 2, 3))
        users, items, rates, times = table.T
    elif name.endswith(".inter"):
        users, items, rates, times = _read_inter(data, path)
    else:
        header = data[: data.find(b"\n")].decode("utf-8", "replace").strip().lower().split(",")
        cols = [_header_col(header, path, (user_col,)),
                _header_col(header, path, (item_col, "movie", "book")),
                _header_col(header, path, (rating_col,)),
                _header_col(header, path, ("timestamp",), required=False)]
        table = _table(data, ",", True, tuple(c for c in cols if c is not None))
        users, items, rates = table[:, 0], table[:, 1], table[:, 2]
        times = table[:, 3] if cols[3] is not None else None
    _refuse_missing(name, {"user": users, "item": items, "rating": rates, "timestamp": times})
    user_ids, num_users = _renumber(users)
    item_ids, num_items = _renumber(items)
    n = len(user_ids)
    rates = np.ones(n) if rates is None else np.asarray(rates, dtype=np.float64)
    if times is not None:
        times = torch.from_numpy(np.asarray(times, dtype=np.float64).astype(np.int64))
    return Ratings(torch.from_numpy(user_ids), torch.from_numpy(item_ids),
                   torch.from_numpy(rates.astype(np.float32)), num_users, num_items, times)


load_movielens = load_ratings


def load_text8(path, *, min_count: int = 5, max_vocab: int | None = None,
               max_member_bytes: int | None = MAX_MEMBER_BYTES,
               max_member_ratio: float | None = MAX_MEMBER_RATIO) -> Corpus:
    """Tokenise text8 (the zip, or any whitespace-separated text file) into word ids.

    Words seen fewer than ``min_count`` times are dropped (as word2vec does); ``max_vocab`` keeps
    only the most frequent words. Ids are ranks: 0 is the most frequent word.
    ``max_member_bytes`` and ``max_member_ratio`` bound what a zip member may expand to (it is
    read into memory whole), and ``max_member_bytes`` a plain file's size too: over either,
    :class:`ArchiveLimitError` says so; None turns one off. Only regular files are read: a FIFO
    or device raises :class:`UnsafeFileError` at once, and so does a symbolic link inside a
    directory (the path you pass may be a link).
    """
    data, _ = _open_member(Path(path), ("text8",), max_member_bytes, max_member_ratio)
    words = data.split()
    counts = Counter(words)
    vocab = sorted((w for w, c in counts.items() if c >= min_count),
                   key=lambda w: (-counts[w], w))
    if max_vocab is not None:
        vocab = vocab[:max_vocab]
    index = {w: i for i, w in enumerate(vocab)}
    ids = np.fromiter((index.get(w, -1) for w in words), dtype=np.int64, count=len(words))
    ids = ids[ids >= 0]
    return Corpus(torch.from_numpy(ids), [w.decode() for w in vocab],
                  torch.tensor([counts[w] for w in vocab], dtype=torch.int64))


def bigram_corpus(corpus: Corpus, min_count: int = 1) -> Corpus:
    """The corpus as a sequence of overlapping word pairs: token ``t`` is ``word[t]_word[t+1]``.

    word2phrase joins a pair into one token when it is frequent enough; this keeps every pair
    seen ``min_count`` times or more (the others are dropped), so its vocabulary is the pairs a
    corpus holds: about 2.9 million in 10.9 million words of English. Ids are ranks, 0 the most
    frequent pair, as :func:`load_text8` numbers words.

    >>> c = Corpus(torch.tensor([0, 1, 0, 1, 2]), ["a", "b", "c"], torch.tensor([2, 2, 1]))
    >>> b = bigram_corpus(c)
    >>> b.vocab, b.ids.tolist(), b.counts.tolist()
    (['a_b', 'b_a', 'b_c'], [0, 1, 0, 2], [2, 1, 1])
    """
    ids = corpus.ids.numpy()
    width = max(len(corpus.vocab), 1)
    pairs = ids[:-1] * width + ids[1:]
    unique, inverse, counts = np.unique(pairs, return_inverse=True, return_counts=True)
    kept = np.flatnonzero(counts >= min_count)
    order = kept[np.lexsort((unique[kept], -counts[kept]))]    # frequent first, then by id
    rank = np.full(len(unique), -1, dtype=np.int64)
    rank[order] = np.arange(len(order))
    new_ids = rank[inverse]
    new_ids = new_ids[new_ids >= 0]
    vocab = [f"{corpus.vocab[int(p // width)]}_{corpus.vocab[int(p % width)]}"
             for p in unique[order]]
    return Corpus(torch.from_numpy(np.ascontiguousarray(new_ids)), vocab,
                  torch.from_numpy(counts[order].astype(np.int64)))


def load(name_or_path, **kwargs):
    """Fetch a registry dataset (or take a local path) and load it: ``Ratings`` or ``Corpus``;
    for the word-vector evaluation sets (``"ws353"``, ``"simlex999"``, ``"questions-words"``
    and their ``-sample`` versions) the lists :mod:`nbtools.models.wordsim` reads.

    Keyword arguments go to the loader (``min_count=`` for text) or to :func:`fetch`
    (``cache_dir=``, ``quiet=``, ...).

    Raises:
        DatasetNotFoundError: ``name_or_path`` is neither a registry name nor an existing
            path; the message lists the names (and the closest one).
    """
    fetch_keys = {"md5", "sha256", "filename", "cache_dir", "retries", "backoff_s", "quiet", "sleep"}
    fetch_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in fetch_keys}
    entry = REGISTRY.get(str(name_or_path))
    if entry is not None:
        path, kind = fetch(entry.name, **fetch_kw), entry.kind
        if kind in ("wordsim", "analogy"):

            return (load_word_pairs if kind == "wordsim" else load_analogies)(path)
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise DatasetNotFoundError(_not_found_message(str(name_or_path)))
        # text: text8's own name, or any .txt file (zipped too: a zip of one .txt file)
        kind = "text" if "text8" in path.name or path.name.endswith((".txt", ".txt.zip")) \
            else "ratings"
    return load_text8(path, **kwargs) if kind == "text" else load_ratings(path, **kwargs)


def _not_found_message(name: str) -> str:
    aliases = {n: n for n in REGISTRY}
    aliases.update({n.replace("ml-", "movielens-"): n for n in REGISTRY if n.startswith("ml-")})
    close = difflib.get_close_matches(name.lower(), aliases, n=1, cutoff=0.6)
    hint = f" Did you mean {aliases[close[0]]!r}?" if close else ""
    return (f"load({name!r}): no dataset of that name and no such file or directory.{hint} "
            f"Dataset names: {', '.join(REGISTRY)}. load('<name>') fetches a named dataset "
            "(cached after the first time); fetch('<url or Drive id>') downloads any other file, "
            "and load(path) reads a local file or directory.")


# --- bundled samples (regenerated by tests/test_data.py to prove they are what this makes) -------

# Topics of the bundled text8-like sample: sentences draw most words from one topic, so that a
# smoke run of word2vec has structure to find (a word's neighbours are its topic's words).
SAMPLE_TOPICS = {
    "numbers": "one two three four five six seven eight nine zero",
    "hardware": "gpu host memory pinned cache page tensor index gather scatter",
    "text": "word rare book paper vector embedding vocabulary sentence corpus letter",
    "movies": "user item movie rating film actor director scene review watch",
    "training": "train step loss rate batch model adam momentum state gradient",
}
_SAMPLE_GLUE = "the of and in a to is as for by that with on are it from".split()


def make_text8_sample(path, words: int = 30000, seed: int = 0) -> None:
    """A text8-like corpus (lowercase words, one line) made of short topical sentences: each
    sentence mixes words of one topic with common glue words, Zipf-like within the topic."""
    rnd = random.Random(seed)
    topics = [t.split() for t in SAMPLE_TOPICS.values()]
    out = []
    while len(out) < words:
        topic = rnd.choice(topics)
        weights = [1.0 / (r + 2) for r in range(len(topic))]
        for _ in range(rnd.randint(6, 12)):
            if rnd.random() < 0.3:
                out.append(rnd.choice(_SAMPLE_GLUE))
            else:
                out.append(rnd.choices(topic, weights)[0])
    Path(path).write_text(" " + " ".join(out[:words]))     # text8 starts with a space


# The bundled ratings sample's planted structure: users rate mostly items of one or two favourite
# genres, so that a recommender has something to learn that popularity alone does not give.
SAMPLE_GENRES = 8
SAMPLE_ITEMS_PER_GENRE = 25


def make_ratings_sample(path, users: int = 300, genres: int = SAMPLE_GENRES,
                        per_genre: int = SAMPLE_ITEMS_PER_GENRE, seed: int = 0) -> None:
    """MovieLens-format ``userId,movieId,rating,timestamp`` with planted genres.

    Each user has one or two favourite genres and rates 15-35 items, 85% of them drawn from the
    favourites and the rest from any genre; within a genre, item ``j`` is drawn with weight
    ``1 / (j + 1) ** 0.8`` (a few popular items, a long tail). A rating is 4 for a favourite
    genre's item and 2.5 for another's, plus the item's quality, the user's bias and noise,
    rounded to half stars. Each user's items come in a random order in time, so that
    :func:`~nbtools.models.leave_last_out` holds out an item like the others (mostly of a
    favourite genre). Movie ids are ``step * (genre + 1) + j + 1``, ``step`` the power of ten
    above ``per_genre`` (gaps, as real ids have, and the genre readable in the file); every item
    is rated, so after :func:`load_ratings` renumbers them, item ``i`` is of genre
    ``i // per_genre``.

    Raises:
        ValueError: too few users for every item to be rated (ids would then shift).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     make_ratings_sample(Path(tmp) / "r.csv", users=40, genres=2, per_genre=10)
    ...     r = load_ratings(Path(tmp) / "r.csv")
    >>> r.num_users, r.num_items
    (40, 20)
    """
    rnd = random.Random(seed)
    quality = [[rnd.gauss(0, 0.4) for _ in range(per_genre)] for _ in range(genres)]
    weights = [1.0 / (j + 1) ** 0.8 for j in range(per_genre)]
    step, rows = 10 ** len(str(per_genre)), []
    for user in range(users):
        favourites = rnd.sample(range(genres), min(genres, rnd.choice((1, 2))))
        bias, count = rnd.gauss(0, 0.3), min(rnd.randint(15, 35), genres * per_genre)
        rated = {}
        while len(rated) < count:
            g = rnd.choice(favourites) if rnd.random() < 0.85 else rnd.randrange(genres)
            j = rnd.choices(range(per_genre), weights)[0]
            if (g, j) not in rated:
                score = 3.0 + (1.0 if g in favourites else -0.5) + quality[g][j] + bias + \
                    rnd.gauss(0, 0.4)
                rated[(g, j)] = min(5.0, max(0.5, math.floor(score * 2 + 0.5) / 2))
        order = list(rated.items())
        rnd.shuffle(order)
        t = 1_000_000_000 + 86_400 * rnd.randrange(3650)
        for (g, j), rating in order:
            t += rnd.randrange(60, 86_400)
            rows.append(f"{user + 1},{step * (g + 1) + j + 1},{rating},{t}")
    unrated = genres * per_genre - len({row.split(",")[1] for row in rows})
    if unrated:
        raise ValueError(f"{users} users leave {unrated} of the {genres * per_genre} items unrated, "
                         f"so item ids would no longer give genres; pass more users")
    Path(path).write_text("userId,movieId,rating,timestamp\n" + "\n".join(rows) + "\n")


def make_planted_ratings(users: int, items: int, *, genres: int = SAMPLE_GENRES,
                         per_user: int = 5, seed: int = 0, chunk: int = 1 << 24) -> Ratings:
    """:func:`make_ratings_sample`'s planted genres at any size, drawn with torch in chunks:
    tens of millions of users and items in seconds, as :class:`Ratings` (no file).

    Item ``i`` is of genre ``i * genres // items``. Each user has one or two favourite genres
    and rates ``per_user`` items, 85% of them from a favourite genre and the rest from any
    genre; within a genre, its ``j``-th item is drawn with weight ``1 / (j + 1) ** 0.8`` (a
    few popular items, a long tail). A rating is 4 for a favourite genre's item and 2.5 for
    another's, plus the item's quality, the user's bias and noise, rounded to half stars,
    clipped to 0.5-5. Timestamps are a random order within each user, so
    :func:`~nbtools.models.leave_last_out` holds out an item like the others. A user may draw
    an item twice (rare past a few thousand items a genre).

    >>> r = make_planted_ratings(1_000, 400, genres=4, per_user=6)
    >>> r.num_users, r.num_items, r.user_ids.numel()
    (1000, 400, 6000)
    """
    if users < 1 or items < genres or per_user < 1:
        raise ValueError(f"make_planted_ratings(users={users}, items={items}, genres={genres}, "
                         f"per_user={per_user}): needs users >= 1, items >= genres, per_user >= 1")
    g = torch.Generator().manual_seed(seed)
    starts = torch.arange(genres + 1, dtype=torch.int64) * items // genres   # genre g's items
    sizes = starts[1:] - starts[:-1]
    # within a genre, the item at rank j with weight 1 / (j + 1) ** 0.8: inverse CDF of the
    # largest genre's weights, scaled to each genre's size
    widest = int(sizes.max())
    cdf = torch.cumsum(1.0 / torch.arange(1, widest + 1, dtype=torch.float64) ** 0.8, 0)
    cdf /= cdf[-1].clone()
    quality = torch.randn(items, generator=g) * 0.4
    bias = torch.randn(users, generator=g) * 0.3
    first = torch.randint(genres, (users,), generator=g)
    second = torch.where(torch.rand(users, generator=g) < 0.5, first,
                         torch.randint(genres, (users,), generator=g))   # one or two favourites
    n = users * per_user
    user_ids = torch.arange(users, dtype=torch.int64).repeat_interleave(per_user)
    item_ids = torch.empty(n, dtype=torch.int64)
    ratings = torch.empty(n, dtype=torch.float32)
    for lo in range(0, n, chunk):
        u = user_ids[lo:lo + chunk]
        m = u.numel()
        pick = torch.where(torch.rand(m, generator=g) < 0.5, first[u], second[u])
        genre = torch.where(torch.rand(m, generator=g) < 0.85, pick,
                            torch.randint(genres, (m,), generator=g))
        rank = torch.searchsorted(cdf, torch.rand(m, generator=g, dtype=torch.float64))
        rank = (rank * sizes[genre] // widest).clamp_max(sizes[genre] - 1)
        item = starts[genre] + rank
        favourite = (genre == first[u]) | (genre == second[u])
        score = (3.0 + torch.where(favourite, 1.0, -0.5) + quality[item] + bias[u]
                 + torch.randn(m, generator=g) * 0.4)
        item_ids[lo:lo + m] = item
        ratings[lo:lo + m] = (score * 2).round().clamp(1, 10) / 2
    timestamps = 1_000_000_000 + torch.randint(10 * 365 * 86_400, (n,), generator=g)
    return Ratings(user_ids, item_ids, ratings, users, items, timestamps)


# --- word-vector evaluation files (nbtools.models.wordsim scores them) ---------------------------

def _read_text(path) -> str:
    """A regular file's text (``path`` may be a link; a FIFO or device raises
    :class:`UnsafeFileError` at once), under the loaders' cap."""
    with open(_open_regular(path, "Pass the path of the text file itself.",
                            follow_symlinks=True), "rb") as f:
        return _read_capped(f, Path(path), MAX_MEMBER_BYTES).decode("utf-8")


def load_word_pairs(path) -> list:
    """``[(word1, word2, score), ...]`` from a WS353 / SimLex-999 file (tab separated, ``#``
    comments)."""
    pairs = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        cols = line.split("\t")
        if len(cols) < 3:
            raise ValueError(f"{path}:{n}: expected 'word1<TAB>word2<TAB>score', got {line!r}")
        pairs.append((cols[0].strip().lower(), cols[1].strip().lower(), float(cols[2])))
    return pairs


def load_analogies(path) -> list:
    """``[(section, a, b, c, d), ...]`` from ``questions-words.txt`` (``a : b = c : d``)."""
    out, section = [], ""
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith(":"):
            section = line[1:].strip()
            continue
        words = line.lower().split()
        if len(words) != 4:
            raise ValueError(f"{path}:{n}: expected four words 'a b c d', got {line!r}")
        out.append((section, *words))
    return out
