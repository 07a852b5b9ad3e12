"""nbtools.data: real downloads (the standard library for URLs, gdown for Drive) from a local
HTTP server, hashes, retries, quota, loaders."""
import hashlib
import http.server
import sys
import threading
import zipfile

import pytest
import torch

from nbtools import data
from nbtools.data import DownloadError, DriveQuotaError, HashMismatchError, fetch

PAYLOAD = bytes(range(256)) * 4000                     # ~1 MB: several gdown chunks
MD5 = hashlib.md5(PAYLOAD).hexdigest()
SHA256 = hashlib.sha256(PAYLOAD).hexdigest()
QUOTA_PAGE = (b"<!DOCTYPE html><html><head><title>Google Drive - Quota exceeded</title></head>"
              b"<body><p class=\"uc-error-subcaption\">Too many users have viewed or downloaded "
              b"this file recently. Please try accessing the file again later.</p></body></html>")
ERROR_PAGE = b"<!DOCTYPE html><html><head><title>500 Internal Server Error</title></head></html>"


class _Handler(http.server.BaseHTTPRequestHandler):
    """Scripted behaviours per path; ``hits`` counts requests."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = self.path.split("?")[0]
        hits = self.server.hits
        hits[path] = n = hits.get(path, 0) + 1
        if path == "/ok.bin" or (path == "/flaky.bin" and n > 1) or (path == "/cut-once.bin" and n > 1):
            return self._send(200, PAYLOAD)
        if path in ("/flaky.bin", "/down.bin"):
            return self._send(500, ERROR_PAGE, "text/html")
        if path in ("/cut-once.bin", "/cut.bin"):
            self.send_response(200)
            self.send_header("Content-Length", str(len(PAYLOAD)))
            self.end_headers()
            self.wfile.write(PAYLOAD[: len(PAYLOAD) // 3])   # then the connection drops
            self.wfile.flush()
            self.close_connection = True
            return None
        if path == "/quota.bin":
            return self._send(200, QUOTA_PAGE, "text/html")
        return self._send(404, b"<html><title>404 Not Found</title></html>", "text/html")

    def _send(self, code, body, ctype="application/octet-stream"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.hits = {}
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv.hits
    srv.shutdown()
    srv.server_close()


class _Sleeps(list):
    def __call__(self, seconds):
        self.append(seconds)


def _get(url, tmp_path, **kw):
    sleeps = _Sleeps()
    path = fetch(url, cache_dir=tmp_path, quiet=True, sleep=sleeps, **kw)
    return path, sleeps


def test_success_verified_and_cached(server, tmp_path):
    base, hits = server
    path, sleeps = _get(f"{base}/ok.bin", tmp_path, md5=MD5, sha256=SHA256)
    assert path.read_bytes() == PAYLOAD and path.name == "ok.bin" and sleeps == []
    before = hits["/ok.bin"]
    again, _ = _get(f"{base}/ok.bin", tmp_path, md5=MD5)
    assert again == path and hits["/ok.bin"] == before          # served from the cache
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".fetch-")]


def test_hash_mismatch_is_clear_and_leaves_nothing(server, tmp_path):
    base, _ = server
    with pytest.raises(HashMismatchError, match=f"md5 of the download is {MD5}, expected 0{{32}}"):
        _get(f"{base}/ok.bin", tmp_path, md5="0" * 32)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_server_error_is_retried_with_backoff(server, tmp_path):
    base, hits = server
    path, sleeps = _get(f"{base}/flaky.bin", tmp_path, md5=MD5, backoff_s=0.5)
    assert path.read_bytes() == PAYLOAD and hits["/flaky.bin"] == 2 and sleeps == [0.5]


def test_server_down_gives_up_after_retries(server, tmp_path):
    base, hits = server
    with pytest.raises(DownloadError, match="after 3 attempts") as e:
        _get(f"{base}/down.bin", tmp_path, retries=2, backoff_s=1.0)
    assert hits["/down.bin"] == 3
    assert "500" in str(e.value) or "HTML page" in str(e.value)


def test_interrupted_download_is_retried(server, tmp_path):
    base, hits = server
    path, sleeps = _get(f"{base}/cut-once.bin", tmp_path, sha256=SHA256)
    assert path.read_bytes() == PAYLOAD and hits["/cut-once.bin"] == 2 and len(sleeps) == 1


def test_always_interrupted_says_so(server, tmp_path):
    base, _ = server
    with pytest.raises(DownloadError, match="after 2 attempts") as e:
        _get(f"{base}/cut.bin", tmp_path, retries=1)
    assert any(w in str(e.value).lower() for w in ("incomplete", "connection", "broken", "bytes"))
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_not_found_is_not_retried(server, tmp_path):
    base, hits = server
    with pytest.raises(DownloadError) as e:
        _get(f"{base}/nope.bin", tmp_path)
    # gdown 6 raises on the 404 (one request); gdown 5 saves the error page, which we spot.
    assert ("404" in str(e.value) and hits["/nope.bin"] == 1) or "HTML page" in str(e.value)


def test_drive_quota_page_gets_the_workaround(server, tmp_path):
    base, _ = server
    with pytest.raises(DriveQuotaError, match="Make a copy"):
        _get(f"{base}/quota.bin", tmp_path)


def test_drive_quota_exception_from_gdown(tmp_path, monkeypatch):
    gdown = pytest.importorskip("gdown")

    def refuse(id=None, **kwargs):                 # gdown's own error for Drive's quota
        assert id == "1AbCdEfGhIjKlMnOpQrStUvWxYz012345"
        raise gdown.exceptions.FileURLRetrievalError(
            "Failed to retrieve file url:\n\n\tToo many users have viewed or downloaded this file "
            "recently. Please try accessing the file again later.")

    monkeypatch.setattr(gdown, "download", refuse)
    with pytest.raises(DriveQuotaError, match="24 h"):
        fetch("https://drive.google.com/file/d/1AbCdEfGhIjKlMnOpQrStUvWxYz012345/view?usp=sharing",
              cache_dir=tmp_path, quiet=True, sleep=lambda s: None)


@pytest.mark.parametrize("source, expected", [
    ("https://drive.google.com/file/d/1AbCdEfGhIjKlMnOpQrStUvWxYz012345/view?usp=sharing",
     ("drive", "1AbCdEfGhIjKlMnOpQrStUvWxYz012345")),
    ("https://drive.google.com/uc?id=1AbCdEfGhIjKlMnOpQrStUvWxYz012345&export=download",
     ("drive", "1AbCdEfGhIjKlMnOpQrStUvWxYz012345")),
    ("https://drive.google.com/open?id=1AbCdEfGhIjKlMnOpQrStUvWxYz012345",
     ("drive", "1AbCdEfGhIjKlMnOpQrStUvWxYz012345")),
    ("1AbCdEfGhIjKlMnOpQrStUvWxYz012345", ("drive", "1AbCdEfGhIjKlMnOpQrStUvWxYz012345")),
    ("https://files.grouplens.org/datasets/movielens/ml-1m.zip",
     ("url", "https://files.grouplens.org/datasets/movielens/ml-1m.zip")),
])
def test_sources_are_recognised(source, expected):
    assert data.parse_source(source) == expected


def test_bad_source_says_what_is_accepted():
    with pytest.raises(ValueError, match="dataset name"):
        fetch("not a thing")


def test_registry_is_honest():
    for d in data.REGISTRY.values():
        for h, n in (("md5", 32), ("sha256", 64)):
            value = getattr(d, h)
            assert value is None or (len(value) == n and int(value, 16) >= 0), (d.name, h)
        if d.url is not None:
            assert d.hash_source, d.name


def test_every_registry_download_is_a_plain_url():
    """No named dataset needs gdown (Google Drive links are for files users bring)."""
    for d in data.REGISTRY.values():
        assert d.url is None or data.parse_source(d.url) == ("url", d.url), d.name


# Known answers published independently of this code: RFC 1321 appendix A.5 (md5) and
# FIPS 180-2 appendix B.1 (sha256) for "abc"; md5/sha256 of the empty string.
@pytest.mark.parametrize("content, md5, sha256", [
    (b"", "d41d8cd98f00b204e9800998ecf8427e",
     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abc", "900150983cd24fb0d6963f7d28e17f72",
     "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (b"12345678901234567890123456789012345678901234567890123456789012345678901234567890",
     "57edf4a22be3c955ac49da2e2107b67a", None),
])
def test_file_hashes_known_answers(tmp_path, content, md5, sha256):
    path = tmp_path / "f.bin"
    path.write_bytes(content)
    got = data.file_hashes(path, chunk_bytes=7)         # several chunks: the update path counts
    assert got["md5"] == md5 and got["bytes"] == len(content)
    assert sha256 is None or got["sha256"] == sha256


def test_fetch_checks_against_a_stated_hash(server, tmp_path):
    # PAYLOAD's md5 stated literally (GNU coreutils `md5sum` of the same bytes), so the check
    # does not compare the fetcher's hasher with itself
    base, _ = server
    path, _ = _get(f"{base}/ok.bin", tmp_path, md5="6134696ca1b050d4564d58a18aa9d35a")
    assert path.read_bytes() == PAYLOAD
    with pytest.raises(HashMismatchError):
        _get(f"{base}/ok.bin", tmp_path / "other", md5="6134696ca1b050d4564d58a18aa9d35b")


def test_load_unknown_name_lists_the_names():
    with pytest.raises(data.DatasetNotFoundError, match="Did you mean 'ml-100k'") as e:
        data.load("movielens-100k")
    assert isinstance(e.value, FileNotFoundError)
    assert "ml-1m" in str(e.value) and "fetch(" in str(e.value)


# --- loaders ------------------------------------------------------------------------------------

RAW = [(10, 200, 4.0), (10, 300, 3.0), (7, 200, 5.0), (42, 100, 1.0)]


TIMES = [881250949, 891717742, 878887116, 1]


def _expect(r, times=True):
    assert r.num_users == 3 and r.num_items == 3
    assert r.user_ids.tolist() == [1, 1, 0, 2] and r.item_ids.tolist() == [1, 2, 1, 0]
    assert r.ratings.tolist() == [4.0, 3.0, 5.0, 1.0] and r.ratings.dtype == torch.float32
    if times:
        assert r.timestamps.tolist() == TIMES and r.timestamps.dtype == torch.int64
    else:
        assert r.timestamps is None


@pytest.mark.parametrize("fmt", ["100k", "1m", "25m", "inter", "goodbooks"])
def test_load_ratings_formats(tmp_path, fmt):
    rows = [(*x, t) for x, t in zip(RAW, TIMES)]
    if fmt == "100k":
        member, text = "ml-100k/u.data", "".join(f"{u}\t{i}\t{int(r)}\t{t}\n" for u, i, r, t in rows)
    elif fmt == "1m":
        member, text = "ml-1m/ratings.dat", "".join(f"{u}::{i}::{int(r)}::{t}\n" for u, i, r, t in rows)
    elif fmt == "25m":
        member = "ml-25m/ratings.csv"
        text = "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in rows)
    elif fmt == "inter":
        member = "ml-100k/ml-100k.inter"
        text = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join(
            f"{u}\t{i}\t{int(r)}\t{t}\n" for u, i, r, t in rows)
    else:
        member = "ratings.csv"
        text = "book_id,user_id,rating\n" + "".join(f"{i},{u},{int(r)}\n" for u, i, r in RAW)
    z = tmp_path / "d.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr(member, text)
    _expect(data.load_ratings(z), times=fmt != "goodbooks")
    (tmp_path / member).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / member).write_text(text)
    _expect(data.load_ratings(tmp_path / member), times=fmt != "goodbooks")
    _expect(data.load(tmp_path / member.split("/")[0] if "/" in member else tmp_path / member),
            times=fmt != "goodbooks")


@pytest.mark.parametrize("line,what", [("2,3,nan", "rating nan"), ("2,3,inf", "rating inf"),
                                       ("nan,3,4", "user nan")])
def test_load_ratings_refuses_missing_or_infinite_values_naming_the_row(tmp_path, line, what):
    """A NaN id would be renumbered into an id of its own, a NaN rating would stop training at
    its first batch: the loader refuses them, naming the data row."""
    path = tmp_path / "ratings.csv"
    path.write_text(f"userId,movieId,rating\n1,2,4\n{line}\n3,4,5\n")
    with pytest.raises(ValueError, match=f"ratings.csv: data row 2 .* has {what}"):
        data.load_ratings(path)


def test_load_inter_with_string_tokens_and_no_rating(tmp_path):
    # RecBole tokens may be any strings; ids follow their sorted order; no rating column -> 1.0
    path = tmp_path / "x.inter"
    path.write_text("session_id:token\titem_id:token\ttimestamp:float\nb\tz9\t5\n")
    with pytest.raises(ValueError, match="no column like"):
        data.load_ratings(path)
    path.write_text("user_id:token\titem_id:token\ttimestamp:float\n"
                    "bob\tz9\t5\nann\tz10\t3\nbob\tz10\t4\n")
    r = data.load_ratings(path)
    assert r.user_ids.tolist() == [1, 0, 1] and r.item_ids.tolist() == [1, 0, 0]
    assert r.ratings.tolist() == [1.0, 1.0, 1.0] and r.timestamps.tolist() == [5, 3, 4]


def test_load_text8(tmp_path):
    z = tmp_path / "text8.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("text8", " b a c a b a d")
    c = data.load_text8(z, min_count=2)
    assert c.vocab == ["a", "b"] and c.counts.tolist() == [3, 2]
    assert c.ids.tolist() == [1, 0, 0, 1, 0]
    assert data.load_text8(z, min_count=1, max_vocab=1).ids.tolist() == [0, 0, 0]


def test_bundled_samples_are_what_the_generators_make(tmp_path):
    data.make_text8_sample(tmp_path / "t.txt")
    data.make_ratings_sample(tmp_path / "r.csv")
    assert (tmp_path / "t.txt").read_bytes() == (data.SAMPLES_DIR / "text8-sample.txt").read_bytes()
    assert (tmp_path / "r.csv").read_bytes() == (data.SAMPLES_DIR / "ratings-sample.csv").read_bytes()
    assert fetch("text8-sample") == data.SAMPLES_DIR / "text8-sample.txt"
    r = data.load("movielens-sample")
    assert r.user_ids.max() == r.num_users - 1 and (r.num_users, r.num_items) == (300, 200)
    assert len(r.ratings) == len((data.SAMPLES_DIR / "ratings-sample.csv").read_text().splitlines()) - 1


def test_ratings_sample_ids_give_genres(tmp_path):
    """Item i of the loaded sample is of genre i // per_genre: the movie id's leading digits."""
    rows = (data.SAMPLES_DIR / "ratings-sample.csv").read_text().splitlines()[1:]
    movie_genre = {int(m): int(m) // 100 - 1 for m in (row.split(",")[1] for row in rows)}
    r = data.load("movielens-sample")
    assert len(movie_genre) == r.num_items == 8 * 25           # every item is rated
    by_item = [movie_genre[m] for m in sorted(movie_genre)]    # the loader numbers in id order
    assert by_item == [i // data.SAMPLE_ITEMS_PER_GENRE for i in range(r.num_items)]
    with pytest.raises(ValueError, match=r"3 users leave \d+ of the 200 items unrated.*more users"):
        data.make_ratings_sample(tmp_path / "few.csv", users=3)


def test_fetch_options_live_in_a_config(tmp_path):
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['retry'\]"):
        fetch("text8-sample", retry=3)
    cfg = data.FetchConfig(cache_dir=tmp_path, quiet=True)
    assert fetch("text8-sample", config=cfg) == fetch("text8-sample", cache_dir=tmp_path, quiet=True)


# --- word-vector evaluation sets ----------------------------------------------------------------

EVAL_SETS = ("ws353", "simlex999", "questions-words")


def test_eval_sets_are_pinned_with_hashes_and_sizes():
    # a tag's raw files (never a branch, which moves), each with md5, sha256 and size; the
    # samples are bundled
    for name in EVAL_SETS:
        d = data.REGISTRY[name]
        assert d.url == ("https://raw.githubusercontent.com/piskvorky/gensim/4.4.0/gensim/test/"
                         f"test_data/{d.filename}"), d.url
        assert d.md5 and d.sha256 and d.bytes and d.kind in ("wordsim", "analogy")
        sample = data.REGISTRY[f"{name}-sample"]
        assert sample.url is None and sample.kind == d.kind
        assert fetch(sample.name) == data.SAMPLES_DIR / sample.filename
    assert (data.REGISTRY["ws353"].md5, data.REGISTRY["questions-words"].bytes) == (
        "fa3334003a2c00a47810856c5813a990", 603_955)     # md5sum / stat of the wheel's copies


def test_eval_sets_download_verified_and_cached(eval_server, tmp_path, monkeypatch):
    files, hits = eval_server
    monkeypatch.setitem(sys.modules, "gdown", None)       # plain URLs: the standard library
    monkeypatch.setitem(sys.modules, "requests", None)    # (using either raises ImportError)
    for name in EVAL_SETS:
        d = data.REGISTRY[name]
        path = fetch(name, cache_dir=tmp_path, quiet=True)
        assert path == tmp_path / name / d.filename
        assert path.read_bytes() == files[f"/gensim/{d.filename}"]
        assert fetch(name, cache_dir=tmp_path, quiet=True) == path      # from the cache
        assert hits[f"/gensim/{d.filename}"] == 1
    pairs = data.load("ws353", cache_dir=tmp_path)
    assert len(pairs) == 31 and all(len(p) == 3 and isinstance(p[2], float) for p in pairs)
    questions = data.load("questions-words", cache_dir=tmp_path)
    assert len(questions) == 25 and questions[0][0] == "topic-to-topic"
    assert data.load("questions-words-sample") == questions             # bundled, same bytes


def test_eval_set_with_a_wrong_hash_or_size_is_refused(eval_server, tmp_path, monkeypatch):
    import dataclasses
    entry = data.REGISTRY["simlex999"]
    monkeypatch.setitem(data.REGISTRY, "simlex999", dataclasses.replace(entry, sha256="0" * 64))
    with pytest.raises(HashMismatchError, match="sha256 of the download is"):
        fetch("simlex999", cache_dir=tmp_path, quiet=True)
    monkeypatch.setitem(data.REGISTRY, "simlex999", dataclasses.replace(entry, bytes=entry.bytes + 1))
    with pytest.raises(DownloadError, match=f"expected {entry.bytes + 1:,}"):
        fetch("simlex999", cache_dir=tmp_path, quiet=True, retries=0)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("missing", ["gdown", "requests"])
def test_missing_downloader_names_gdown_and_the_install_line(tmp_path, monkeypatch, missing):
    if missing == "requests":       # (where gdown itself is missing, the message names gdown)
        pytest.importorskip("gdown")
    if missing == "requests":       # gdown is there: it must not be called
        monkeypatch.setattr(sys.modules["gdown"], "download",
                            lambda **kw: pytest.fail("tried to download"))
    monkeypatch.setitem(sys.modules, missing, None)     # `import gdown` now raises ImportError
    with pytest.raises(ImportError) as err:           # a Google Drive link needs gdown
        data.fetch("https://drive.google.com/file/d/1AbCdEfGhIjKlMnOpQrStUvWxYz012345/view",
                   cache_dir=tmp_path)
    msg = str(err.value)
    assert "needs gdown" in msg and '%pip install gdown' in msg
    assert missing in msg                                                 # what was missing


def test_plain_urls_need_no_gdown(server, tmp_path, monkeypatch):
    """The evaluation sets and MovieLens are plain http(s) URLs: the standard library fetches
    them, retries included, with gdown and requests not importable."""
    base, _ = server
    monkeypatch.setitem(sys.modules, "gdown", None)      # using either raises ImportError
    monkeypatch.setitem(sys.modules, "requests", None)
    path, _ = _get(f"{base}/ok.bin", tmp_path, md5=MD5)
    assert path.read_bytes() == PAYLOAD
    with pytest.raises(data.DownloadError, match="HTTP 404"):
        _get(f"{base}/missing.bin", tmp_path)


def test_a_cached_file_needs_no_downloader(server, tmp_path, monkeypatch):
    base, _ = server
    path, _ = _get(f"{base}/ok.bin", tmp_path, md5=MD5)
    monkeypatch.setitem(sys.modules, "gdown", None)
    assert _get(f"{base}/ok.bin", tmp_path, md5=MD5)[0] == path


# --- what is on disk is checked, not trusted --------------------------------------------------

def _plant(path, body, claims):
    """A file at ``path`` and a sidecar that vouches for it as a finished download would:
    size and mtime match the file, the hashes are ``claims`` (copied from the registry)."""
    import json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    st = path.stat()
    data.sidecar_path(path).write_text(json.dumps({
        "bytes": st.st_size, "md5": claims["md5"], "sha256": claims["sha256"],
        "url": "planted", "verified": True, "mtime_ns": st.st_mtime_ns}))


def _planted_ws353(entry):
    """Well-formed WS353 lines the size of the real file, so that only the hash tells."""
    lines = b"planted\tpairs\t10.0\n" * 8
    return lines + b"#" + b"x" * (entry.bytes - len(lines) - 2) + b"\n"


def test_planted_file_with_a_matching_sidecar_is_not_used(eval_server, tmp_path):
    """A file planted in the cache beside a sidecar claiming the pinned hashes, with its size
    and mtime, is hashed, refused with a warning naming it, and the real file is downloaded."""
    files, hits = eval_server
    entry = data.REGISTRY["ws353"]
    cached = tmp_path / "ws353" / entry.filename
    _plant(cached, _planted_ws353(entry), {"md5": entry.md5, "sha256": entry.sha256})
    assert data.load_word_pairs(cached)[0] == ("planted", "pairs", 10.0)   # would load
    with pytest.warns(UserWarning, match=f"{cached}: the cached file is not the expected one "
                                         r"\(md5 is .*, expected .*, pinned\)"):
        pairs = data.load("ws353", cache_dir=tmp_path, quiet=True)
    assert hits.get(f"/gensim/{entry.filename}") == 1                        # downloaded again
    assert ("planted", "pairs", 10.0) not in pairs
    assert pairs == data.load_word_pairs(data.SAMPLES_DIR / "wordsim353-sample.tsv")
    assert cached.read_bytes() == files[f"/gensim/{entry.filename}"]


def test_planted_file_is_refused_even_when_no_download_can_replace_it(eval_server, tmp_path):
    files, hits = eval_server
    entry = data.REGISTRY["ws353"]
    del files[f"/gensim/{entry.filename}"]                                # the server: 404
    cached = tmp_path / "ws353" / entry.filename
    _plant(cached, _planted_ws353(entry), {"md5": entry.md5, "sha256": entry.sha256})
    with pytest.warns(UserWarning, match="not the expected one"), \
            pytest.raises(DownloadError, match="HTTP 404"):
        data.load("ws353", cache_dir=tmp_path, quiet=True)
    assert not cached.exists() and not data.sidecar_path(cached).exists()


def test_pinned_cache_hit_is_hashed_on_every_use(eval_server, tmp_path, monkeypatch):
    """The genuine cached file is served without a download, after hashing it once."""
    files, hits = eval_server
    path = fetch("ws353", cache_dir=tmp_path, quiet=True)
    calls = []
    hashes = data.file_hashes
    monkeypatch.setattr(data, "file_hashes", lambda p, *a: calls.append(p) or hashes(p, *a))
    assert fetch("ws353", cache_dir=tmp_path, quiet=True) == path
    assert calls == [path] and hits["/gensim/wordsim353.tsv"] == 1


def test_unpinned_file_changed_after_its_download_is_fetched_again(server, tmp_path):
    """Nothing pinned: the sidecar's hashes of the first download are the reference."""
    import os
    base, hits = server
    path, _ = _get(f"{base}/ok.bin", tmp_path)
    before = hits["/ok.bin"]
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))     # touched, same bytes
    assert _get(f"{base}/ok.bin", tmp_path)[0] == path and hits["/ok.bin"] == before
    path.write_bytes(b"X" * len(PAYLOAD))                              # same size, other bytes
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    with pytest.warns(UserWarning, match=f"{path}: .*recorded in its sidecar at the download"):
        again, _ = _get(f"{base}/ok.bin", tmp_path)
    assert again.read_bytes() == PAYLOAD and hits["/ok.bin"] == before + 1


def test_registry_downloads_are_https_and_text8_is_pinned():
    for d in data.REGISTRY.values():
        assert d.url is None or d.url.startswith("https://"), (d.name, d.url)
    text8 = data.REGISTRY["text8"]
    assert text8.url == "https://mattmahoney.net/dc/text8.zip"
    # the md5 the Keras/TensorFlow text8 loaders pin, the size of the word2vec tutorials
    assert (text8.md5, text8.bytes) == ("f26f94c5209bc6159618bad4a559ff81", 31_344_016)


# --- archive members: streamed, under a cap ------------------------------------------------------

def _bomb(path, member_bytes, pattern=b"a "):
    """A deflated zip of one member "text8" of ``member_bytes`` bytes of ``pattern`` (~1000:1)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z, z.open("text8", "w") as f:
        block = pattern * ((1 << 20) // len(pattern))
        for _ in range(member_bytes // len(block)):
            f.write(block)
    return path


def _peak_bytes(fn, *args, **kwargs):
    """(exception raised or None, peak bytes Python allocated meanwhile)."""
    import tracemalloc
    tracemalloc.start()
    try:
        fn(*args, **kwargs)
        err = None
    except Exception as e:
        err = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return err, peak


def test_zip_bomb_is_refused_before_it_is_read(tmp_path):
    """A 200 MB member in a ~200 KB zip (the issue's bomb, smaller): refused for its ratio with
    the defaults, for its size under a smaller cap, before its bytes are read."""
    z = _bomb(tmp_path / "text8.zip", 200 << 20)
    assert z.stat().st_size < 300_000
    err, peak = _peak_bytes(data.load_text8, z)
    assert isinstance(err, data.ArchiveLimitError), err
    assert f"{z}: member 'text8'" in str(err) and "over the limit of 100:1" in str(err)
    assert "max_member_ratio=" in str(err)
    assert peak < 2 << 20
    err, peak = _peak_bytes(data.load_text8, z, max_member_bytes=10 << 20, max_member_ratio=None)
    assert isinstance(err, data.ArchiveLimitError), err
    assert "declares 209,715,200 bytes uncompressed, over the cap of 10,485,760" in str(err)
    assert "max_member_bytes=" in str(err)
    assert peak < 2 << 20
    # the same arguments through load(), and a member under the limits still loads
    with pytest.raises(data.ArchiveLimitError, match="over the cap of 1,048,576"):
        data.load(z, max_member_bytes=1 << 20)
    (tmp_path / "small").mkdir()
    c = data.load_text8(_bomb(tmp_path / "small" / "text8.zip", 4 << 20), min_count=1)
    assert c.vocab == ["a"] and len(c.ids) == 2 << 20


class _Endless:
    """A member reader that ignores the archive's directory: zeros for as long as it is read
    (up to 64 MiB, so that a reader that does not count fails here rather than hangs)."""

    def __init__(self):
        self.produced = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self, n):
        n = max(0, min(n, (64 << 20) - self.produced))
        self.produced += n
        return bytes(n)


@pytest.mark.parametrize("cap, ratio, limit, arg", [
    (10 << 20, None, 10 << 20, "max_member_bytes"),
    (None, 100.0, 16 << 20, "max_member_ratio"),     # the ratio's floor: small members pass
])
def test_member_bytes_are_counted_not_taken_from_the_directory(tmp_path, monkeypatch, cap, ratio,
                                                               limit, arg):
    """The directory says 1,000 bytes; the reader goes on: reading stops at the limit."""
    z = tmp_path / "text8.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("text8", b"a " * 500)
    reader = _Endless()
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda self, *a, **kw: reader)
    err, peak = _peak_bytes(data.load_text8, z, max_member_bytes=cap, max_member_ratio=ratio)
    assert isinstance(err, data.ArchiveLimitError), err
    assert f"declares 1,000 bytes uncompressed but goes on past {limit:,} bytes" in str(err)
    assert f"{arg}=" in str(err)
    assert limit < reader.produced <= limit + 1
    assert peak < limit + (4 << 20)


def test_zip_whose_directory_understates_a_member_is_refused(tmp_path):
    """A real archive whose central directory says 1,000 bytes for a 50 MB member: zipfile
    stops at the declared size and finds the CRC wrong; the error names the archive."""
    z = _bomb(tmp_path / "text8.zip", 50 << 20)
    raw = bytearray(z.read_bytes())
    at = raw.rindex(b"PK\x01\x02")                     # the one central directory entry
    assert int.from_bytes(raw[at + 24:at + 28], "little") == 50 << 20
    raw[at + 24:at + 28] = (1000).to_bytes(4, "little")
    z.write_bytes(bytes(raw))
    assert zipfile.ZipFile(z).getinfo("text8").file_size == 1000
    err, peak = _peak_bytes(data.load_text8, z)
    assert isinstance(err, zipfile.BadZipFile), err
    assert f"{z}: member 'text8'" in str(err) and "does not match the archive's directory" in str(err)
    assert peak < 4 << 20


def test_deflated_text8_sample_loads_as_the_plain_file(tmp_path):
    z = tmp_path / "text8.zip"
    with zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as f:
        f.write(data.SAMPLES_DIR / "text8-sample.txt", "text8")
    got, want = data.load_text8(z), data.load("text8-sample")
    assert got.vocab == want.vocab and torch.equal(got.ids, want.ids)


def test_planted_ratings_carry_their_genres():
    """Each user's ratings come mostly from one or two favourite genres (85% of draws), and a
    favourite genre's items are rated higher: structure a recommender can learn, at any size."""
    genres, items = 8, 800
    r = data.make_planted_ratings(2_000, items, genres=genres, per_user=20, seed=1)
    assert (r.num_users, r.num_items, r.user_ids.numel()) == (2_000, items, 40_000)
    assert 0 <= int(r.item_ids.min()) and int(r.item_ids.max()) < items
    genre = r.item_ids * genres // items
    per_user = torch.zeros(r.num_users, genres).index_put_(
        (r.user_ids, genre), torch.ones(len(genre)), accumulate=True)
    top2 = per_user.topk(2, dim=1).values.sum(1) / per_user.sum(1)
    assert float(top2.mean()) > 0.8            # uniform genres would give 2/8
    favourite = per_user[r.user_ids, genre] >= per_user.topk(2, dim=1).values[r.user_ids, 1]
    assert float(r.ratings[favourite].mean()) > float(r.ratings[~favourite].mean()) + 1.0
    assert set((r.ratings * 2).unique().tolist()) <= set(range(1, 11))   # half stars, 0.5-5
    again = data.make_planted_ratings(2_000, items, genres=genres, per_user=20, seed=1)
    assert torch.equal(again.item_ids, r.item_ids) and torch.equal(again.ratings, r.ratings)


def test_bigram_corpus_pairs_each_word_with_the_next(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(" the cat sat on the mat the cat ran")
    words = data.load(path, min_count=1)
    pairs = data.bigram_corpus(words)
    assert pairs.vocab[0] == "the_cat" and int(pairs.counts[0]) == 2
    tokens = [pairs.vocab[i] for i in pairs.ids.tolist()]
    assert tokens == ["the_cat", "cat_sat", "sat_on", "on_the", "the_mat", "mat_the", "the_cat",
                      "cat_ran"]
    assert data.bigram_corpus(words, min_count=2).vocab == ["the_cat"]
    assert data.bigram_corpus(words, min_count=2).ids.tolist() == [0, 0]


def test_a_zipped_txt_loads_as_text(tmp_path):
    z = tmp_path / "corpus.txt.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("corpus.txt", " b a c a b a d")
    c = data.load(z, min_count=2)
    assert c.vocab == ["a", "b"] and c.ids.tolist() == [1, 0, 0, 1, 0]
