"""nbtools.data with a cache or dataset folder handed over by someone else (a shared Drive
folder, a lab server): links below the cache root are never followed or written through, a
FIFO or /dev/zero never hangs or fills memory, and what fetch() makes is its user's alone.

Calls that hung (or read without end) before these checks run in a child process under a
timeout and a memory limit, so that a regression fails the test instead of stalling the run."""
import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from nbtools import data
from nbtools.data import UnsafeFileError, fetch

BODY = b"user,item,rating\n1,2,3\n4,5,1\n"
MD5 = hashlib.md5(BODY).hexdigest()
VICTIM = b"precious user data\n"


@pytest.fixture
def site(file_server):
    """``(url, hits)``: ``BODY`` served at ``url`` by the shared local server (no network)."""
    base, files, hits = file_server
    files["/ratings.csv"] = BODY
    return f"{base}/ratings.csv", hits


def _key_folder(cache, url):
    """The cache's folder for a plain URL (its name is the URL's hash, as fetch() makes it)."""
    return cache / ("url-" + hashlib.sha1(url.encode()).hexdigest()[:12])


def _fake_sidecar(path):
    """A sidecar beside ``path`` that claims a finished download."""
    data.sidecar_path(path).write_text(json.dumps(
        {"bytes": 0, "md5": "x", "sha256": "y", "url": "planted", "verified": True,
         "mtime_ns": 0}))


def _isolated(code: str, timeout: float = 60, memory: int = 3 << 30):
    """Run ``code`` (after ``from nbtools import data``) in a child process limited to
    ``memory`` bytes of address space; fail the test if it is still running after
    ``timeout`` seconds (it hung). Returns the finished process (stdout, stderr as text)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    script = "import warnings\nfrom nbtools import data\n" + textwrap.dedent(code)
    try:
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s (it hangs):\n{script}")


def _refusal(call: str, memory: int = 3 << 30) -> str:
    """What the child process printed: ``REFUSED <message>`` where ``call`` raised
    :class:`UnsafeFileError` (within 30 s and ``memory`` bytes)."""
    done = _isolated(f"""
        try:
            {call}
        except data.UnsafeFileError as e:
            print("REFUSED", e)
    """, timeout=30, memory=memory)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _special(path, kind, outside=None):
    """Make ``path`` a FIFO, a link to /dev/zero, or a link to ``outside``."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    else:
        path.symlink_to(outside)


# --- fetch(): the cache ------------------------------------------------------------------------

def test_sidecar_link_is_replaced_not_written_through(site, tmp_path):
    url, _ = site
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    folder = _key_folder(tmp_path / "cache", url)
    folder.mkdir(parents=True)
    side = folder / ".ratings.csv.nbtools.json"
    side.symlink_to(victim)
    path = fetch(url, cache_dir=tmp_path / "cache", quiet=True, retries=0)
    assert victim.read_bytes() == VICTIM                          # byte for byte
    assert path.read_bytes() == BODY
    assert stat.S_ISREG(os.lstat(side).st_mode)                  # the link itself was replaced
    assert json.loads(side.read_text())["md5"] == MD5


def test_sidecar_link_beside_a_cached_file_is_a_miss(site, tmp_path):
    """A cached file whose sidecar is a link (to a file that would vouch for it) is not used:
    warned about, downloaded again; the link's target is left alone."""
    url, hits = site
    cache = tmp_path / "cache"
    path = fetch(url, cache_dir=cache, quiet=True, retries=0)
    side = data.sidecar_path(path)
    outside = tmp_path / "vouch.json"
    outside.write_bytes(side.read_bytes())
    side.unlink()
    side.symlink_to(outside)
    before, kept = hits["/ratings.csv"], outside.read_bytes()
    with pytest.warns(UserWarning, match=f"{side} is a symbolic link .*fetching it again"):
        assert fetch(url, cache_dir=cache, quiet=True, retries=0) == path
    assert hits["/ratings.csv"] == before + 1 and outside.read_bytes() == kept
    assert stat.S_ISREG(os.lstat(side).st_mode)


def test_cached_file_linked_outside_is_not_read(site, tmp_path):
    """An unpinned cache hit that is a link to an outside file, beside a sidecar matching that
    file's size and mtime (trust on first use would take it), is refused and replaced."""
    url, hits = site
    secret = tmp_path / "secret.csv"
    secret.write_bytes(b"user,item,rating\n111,222,5\n")
    folder = _key_folder(tmp_path / "cache", url)
    folder.mkdir(parents=True)
    (folder / "ratings.csv").symlink_to(secret)
    st = secret.stat()
    data.sidecar_path(folder / "ratings.csv").write_text(json.dumps(
        {"bytes": st.st_size, "md5": "m", "sha256": "s", "url": url, "verified": False,
         "mtime_ns": st.st_mtime_ns}))
    with pytest.warns(UserWarning, match="is a symbolic link .*fetching it again"):
        path = fetch(url, cache_dir=tmp_path / "cache", quiet=True, retries=0)
    assert stat.S_ISREG(os.lstat(path).st_mode) and path.read_bytes() == BODY
    assert secret.read_bytes() == b"user,item,rating\n111,222,5\n"


def test_source_folder_link_is_refused_and_nothing_written(site, tmp_path):
    url, hits = site
    outside = tmp_path / "home_docs"
    outside.mkdir()
    (outside / "ratings.csv").write_bytes(VICTIM)
    cache = tmp_path / "cache"
    cache.mkdir()
    _key_folder(cache, url).symlink_to(outside)
    with pytest.raises(UnsafeFileError, match=f"{_key_folder(cache, url)} is a symbolic link "
                                              r".*Remove it .*cache_dir="):
        fetch(url, cache_dir=cache, quiet=True, retries=0)
    assert sorted(p.name for p in outside.iterdir()) == ["ratings.csv"]
    assert (outside / "ratings.csv").read_bytes() == VICTIM
    assert hits.get("/ratings.csv") is None                       # not even downloaded


def test_registry_folder_link_is_refused(tmp_path, monkeypatch):
    """A registry name's folder (``ml-1m``) too; the cache root itself may be a link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    real_root = tmp_path / "drive"
    real_root.mkdir()
    (tmp_path / "root-link").symlink_to(real_root)                # the user's own link: fine
    (real_root / "ml-1m").symlink_to(outside)
    with pytest.raises(UnsafeFileError, match="ml-1m is a symbolic link"):
        fetch("ml-1m", cache_dir=tmp_path / "root-link", quiet=True, retries=0)
    assert list(outside.iterdir()) == []


def test_cache_root_may_be_a_link(site, tmp_path):
    url, _ = site
    real = tmp_path / "drive"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    path = fetch(url, cache_dir=tmp_path / "link", quiet=True, retries=0)
    assert path.read_bytes() == BODY and (_key_folder(real, url) / "ratings.csv").is_file()


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_pinned_cache_hit_that_is_a_fifo_or_dev_zero_does_not_hang(site, tmp_path, kind):
    """A pinned cache hit is hashed on every use: a FIFO or a link to /dev/zero there is a
    miss, warned about and replaced by the download, at once."""
    url, _ = site
    cache = tmp_path / "cache"
    folder = _key_folder(cache, url)
    folder.mkdir(parents=True)
    _special(folder / "ratings.csv", kind)
    _fake_sidecar(folder / "ratings.csv")
    done = _isolated(f"""
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            p = data.fetch({url!r}, md5={MD5!r}, cache_dir={str(cache)!r}, quiet=True,
                           retries=0)
        print("WARN", *[str(x.message) for x in w])
        print("GOT", p.read_bytes() == {BODY!r})
    """, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "GOT True" in done.stdout
    what = "a FIFO (named pipe)" if kind == "fifo" else "a symbolic link (to '/dev/zero')"
    assert f"WARN {folder / 'ratings.csv'} is {what}, where a download leaves a regular " \
           "file" in done.stdout and "fetching it again" in done.stdout, done.stdout
    assert stat.S_ISREG(os.lstat(folder / "ratings.csv").st_mode)


def test_folder_at_the_cached_files_name_is_refused(site, tmp_path):
    url, _ = site
    folder = _key_folder(tmp_path / "cache", url)
    (folder / "ratings.csv").mkdir(parents=True)
    with pytest.raises(UnsafeFileError, match="ratings.csv is a folder.*Move or remove"):
        fetch(url, cache_dir=tmp_path / "cache", quiet=True, retries=0)


@pytest.mark.parametrize("name", ["../escape.csv", "a/b.csv", ".."])
def test_filename_must_be_a_plain_name(site, tmp_path, name):
    url, _ = site
    with pytest.raises(ValueError, match="not a plain file name"):
        fetch(url, filename=name, cache_dir=tmp_path / "cache", quiet=True, retries=0)
    assert not (tmp_path / "escape.csv").exists()


def test_what_fetch_creates_is_private_under_umask_022(site, tmp_path):
    url, _ = site
    old = os.umask(0o022)
    try:
        os.chmod(tmp_path, 0o755)                        # a shared place such as /tmp/run1
        path = fetch(url, cache_dir=tmp_path / "a" / "cache", quiet=True, retries=0)
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(os.lstat(p).st_mode)
    assert mode(tmp_path) == 0o755                                 # existing: left as it is
    for made in (tmp_path / "a", tmp_path / "a" / "cache", path.parent):
        assert mode(made) == 0o700, made
    assert mode(path) == 0o600 and mode(data.sidecar_path(path)) == 0o600


# --- load(): a dataset folder or file ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_load_of_a_folder_with_a_fifo_or_dev_zero_is_refused_at_once(tmp_path, kind):
    folder = tmp_path / "ml-shared"
    folder.mkdir()
    _special(folder / "ratings.csv", kind)
    said = _refusal(f"data.load({str(folder)!r})", memory=2 << 30)
    assert f"REFUSED {folder / 'ratings.csv'} is a " in said and "regular file" in said, said


def test_load_of_a_folder_with_a_link_outside_is_refused(tmp_path):
    secret = tmp_path / "secret.csv"
    secret.write_bytes(b"user,item,rating\n111,222,5\n")
    folder = tmp_path / "ml-shared"
    folder.mkdir()
    (folder / "ratings.csv").symlink_to(secret)
    with pytest.raises(UnsafeFileError, match=f"{folder / 'ratings.csv'} is a symbolic link "
                                              r"\(to .*secret.csv'\), not a regular file"):
        data.load(folder)
    assert secret.read_bytes() == b"user,item,rating\n111,222,5\n"


def test_load_of_a_fifo_named_by_the_user_is_refused_at_once(tmp_path):
    fifo = tmp_path / "ratings.csv"
    os.mkfifo(fifo)
    assert f"REFUSED {fifo} is a FIFO" in _refusal(f"data.load_ratings({str(fifo)!r})")


def test_a_link_the_user_names_is_loaded(tmp_path):
    real = tmp_path / "real.csv"
    real.write_bytes(BODY)
    (tmp_path / "mine.csv").symlink_to(real)
    assert data.load(tmp_path / "mine.csv").num_users == 2


def test_plain_file_is_read_under_the_cap(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_bytes(BODY)
    with pytest.raises(data.ArchiveLimitError, match=f"{path} is {len(BODY)} bytes, over the "
                                                     "cap of 10 bytes.*max_member_bytes="):
        data.load_ratings(path, max_member_bytes=10)
    with pytest.raises(data.ArchiveLimitError, match="over the cap"):
        data.load(tmp_path, max_member_bytes=10)                    # in a folder too
    assert data.load_ratings(path, max_member_bytes=len(BODY)).num_users == 2


def test_a_folder_at_the_sidecars_name_is_named_not_a_raw_error(tmp_path, site):
    """The record of a download cannot replace a folder planted at its name: a clear error
    naming it (the download itself is kept)."""
    url, _ = site
    cache = tmp_path / "cache"
    path = fetch(url, cache_dir=cache, quiet=True)
    side = data.sidecar_path(path)
    side.unlink()
    path.unlink()
    side.mkdir()
    with pytest.raises(UnsafeFileError, match="is a folder, where the data cache keeps the "
                                              "record"):
        fetch(url, cache_dir=cache, quiet=True)
    assert side.is_dir() and path.is_file()
