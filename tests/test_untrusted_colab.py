"""A folder someone else handed over is data: nbtools.colab.installed() runs nothing a copied
checkout's git configuration names and never hangs or raises on an odd install; drive_dir makes
its folders 0700 and refuses links and other users' or shared-writable folders below the root;
Dashboard.save_png never writes through a link or blocks on a FIFO."""
import json
import os
import shutil
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

import nbtools
from nbtools import colab
from nbtools.colab import DriveError, drive_dir
from nbtools.dashboard import Dashboard, DashboardConfig

OTHER_UID = 12345
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")


def in_time(fn, *args, timeout=10.0):
    """fn(*args)'s result; TimeoutError when it blocks longer than ``timeout``."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout)
    finally:
        pool.shutdown(wait=False)


def unblock(fifo):
    """Open ``fifo``'s ends so a reader or writer stuck on it (a failed test) returns."""
    for flags in (os.O_RDONLY, os.O_WRONLY):
        try:
            os.close(os.open(fifo, flags | os.O_NONBLOCK))
        except OSError:
            pass


# --- installed(): a checkout handed over --------------------------------------------------------

def _checkout(path):
    """A git checkout at ``path`` with one commit; (run git there, that commit)."""
    (path / "nbtools").mkdir(parents=True)
    (path / "nbtools" / "__init__.py").write_text("")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*args):
        out = subprocess.run(["git", "-C", str(path), *args], env=env, check=True,
                             capture_output=True, text=True)
        return out.stdout.strip()
    for args in (["init", "-q"], ["add", "nbtools"], ["commit", "-q", "-m", "one"]):
        git(*args)
    return git, git("rev-parse", "HEAD")


@needs_git
def test_installed_runs_nothing_a_copied_checkouts_config_names(tmp_path, monkeypatch):
    monkeypatch.delenv("NBTOOLS_COMMIT", raising=False)
    repo = tmp_path / "shared"
    git, head = _checkout(repo)
    marker = tmp_path / "ran"
    planted = f"sh -c 'id > {marker}; echo' #"
    git("config", "core.fsmonitor", planted)
    git("config", "filter.evil.clean", f"sh -c 'id > {marker}; cat'")
    git("config", "core.hooksPath", str(tmp_path / "hooks"))
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "attributes").write_text("* filter=evil\n")
    (repo / "nbtools" / "__init__.py").write_text("x = 1\n")    # so status reads the file
    line = colab.installed(repo / "nbtools")
    assert not marker.exists(), marker.read_text()
    assert line == (f"nbtools {nbtools.__version__} from the git checkout at {repo.resolve()} "
                    f"(commit {head}, with uncommitted changes)")


@needs_git
def test_installed_still_reports_a_normal_checkouts_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("NBTOOLS_COMMIT", raising=False)
    repo = tmp_path / "clone"
    git, head = _checkout(repo)
    want = f"nbtools {nbtools.__version__} from the git checkout at {repo.resolve()} (commit {head}"
    assert colab.installed(repo / "nbtools") == want + ")"
    git("pack-refs", "--all")                            # the branch only in packed-refs
    assert list((repo / ".git" / "refs" / "heads").iterdir()) == []
    assert colab.installed(repo / "nbtools") == want + ")"
    git("checkout", "-q", "--detach")
    assert colab.installed(repo / "nbtools") == want + ")"


@needs_git
@needs_root
def test_installed_does_not_run_git_for_another_users_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("NBTOOLS_COMMIT", raising=False)
    repo = tmp_path / "theirs"
    _, head = _checkout(repo)
    os.chown(repo, OTHER_UID, OTHER_UID)
    line = colab.installed(repo / "nbtools")
    assert f"(commit {head}; not checked for uncommitted changes" in line


# --- installed(): an odd distribution record ---------------------------------------------------

def _install(tmp_path):
    site = tmp_path / "site"
    (site / "nbtools").mkdir(parents=True)
    info = site / "nbtools_offload-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nbtools-offload\n"
                                   "Version: 0.1.0\n")
    return site / "nbtools", info


NO_SOURCE = "installed without a recorded source"


@pytest.mark.parametrize("name", ["direct_url.json", "METADATA"])
def test_installed_does_not_block_on_a_fifo(tmp_path, name):
    package, info = _install(tmp_path)
    fifo = info / name
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    try:
        line = in_time(colab.installed, package)
    finally:
        unblock(fifo)
    assert line.startswith("nbtools ")


def test_installed_does_not_read_a_device(tmp_path):
    package, info = _install(tmp_path)
    (info / "direct_url.json").symlink_to("/dev/zero")
    assert NO_SOURCE in in_time(colab.installed, package)


@pytest.mark.parametrize("record", [
    '{"url": "x", "vcs_info": [1]}', '{"url": "x", "vcs_info": {"commit_id": 5}}',
    '{"url": 3}', "[1, 2]", "{not json", "\xff\xfe", '{"url": "' + "x" * (1 << 17) + '"}',
    "[" * 100000 + "]" * 100000],
    ids=["vcs-list", "commit-int", "url-int", "list", "bad-json", "bad-utf8", "too-big", "deep"])
def test_installed_takes_a_malformed_record_for_none(tmp_path, record):
    package, info = _install(tmp_path)
    (info / "direct_url.json").write_text(record, errors="surrogateescape")
    assert NO_SOURCE in colab.installed(package)


def test_installed_reads_a_good_record_still(tmp_path):
    package, info = _install(tmp_path)
    (info / "direct_url.json").write_text(json.dumps(
        {"url": "u", "vcs_info": {"vcs": "git", "commit_id": "c0ffee"}}))
    assert colab.installed(package) == "nbtools 0.1.0 from git+u (commit c0ffee)"


# --- drive_dir ---------------------------------------------------------------------------------

@pytest.fixture
def shared_root(tmp_path, monkeypatch):
    """A place everyone writes to, like /tmp/lab (the root is the user's choice)."""
    monkeypatch.setattr(colab, "in_colab", lambda: False)
    root = tmp_path / "lab"
    root.mkdir()
    root.chmod(0o1777)
    return root


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_drive_dir_makes_its_folders_private(shared_root):
    old = os.umask(0o002)
    try:
        path = drive_dir("runs/demo", root=shared_root)
    finally:
        os.umask(old)
    assert path == shared_root / "runs" / "demo"
    assert mode(shared_root / "runs") == 0o700 and mode(path) == 0o700
    assert drive_dir("runs/demo", root=shared_root) == path          # again: its own folders


def test_drive_dir_makes_a_missing_root_private(tmp_path, monkeypatch):
    monkeypatch.setattr(colab, "in_colab", lambda: False)
    drive_dir("x", root=tmp_path / "new" / "root")
    assert mode(tmp_path / "new") == 0o700 and mode(tmp_path / "new" / "root") == 0o700


def test_drive_dir_refuses_a_planted_link(shared_root, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    (shared_root / "linked").symlink_to(theirs)
    with pytest.raises(DriveError, match="symbolic link"):
        drive_dir("linked/run", root=shared_root)
    assert list(theirs.iterdir()) == []
    (shared_root / "dangling").symlink_to(tmp_path / "nothing")
    with pytest.raises(DriveError, match="symbolic link"):
        drive_dir("dangling", root=shared_root)
    assert not (tmp_path / "nothing").exists()


@needs_root
def test_drive_dir_refuses_another_users_folder(shared_root):
    (shared_root / "open").mkdir()
    os.chown(shared_root / "open", OTHER_UID, OTHER_UID)
    (shared_root / "open").chmod(0o755)
    with pytest.raises(DriveError, match="another user"):
        drive_dir("open/run", root=shared_root)
    assert not (shared_root / "open" / "run").exists()


def test_drive_dir_refuses_a_folder_others_may_write(shared_root):
    (shared_root / "open").mkdir()
    (shared_root / "open").chmod(0o777)
    with pytest.raises(DriveError, match="chmod o-w"):
        drive_dir("open", root=shared_root)
    (shared_root / "mine").mkdir()
    (shared_root / "mine").chmod(0o775)          # (umask 002 with a group of one's own)
    assert drive_dir("mine", root=shared_root) == shared_root / "mine"
    (shared_root / "file").write_text("")
    with pytest.raises(DriveError, match="not a folder"):
        drive_dir("file/x", root=shared_root)
    with pytest.raises(DriveError, match="below"):
        drive_dir("../escape", root=shared_root)


def test_drive_dir_root_may_be_a_link(tmp_path, monkeypatch):
    monkeypatch.setattr(colab, "in_colab", lambda: False)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("NBTOOLS_DRIVE_DIR", str(tmp_path / "link"))
    assert drive_dir("a/b") == tmp_path / "link" / "a" / "b"
    assert (tmp_path / "real" / "a" / "b").is_dir()


def test_drive_dir_on_a_drive_like_mount(tmp_path, monkeypatch):
    """Drive's FUSE mount shows folders as the user's, mode 0700: drive_dir takes them."""
    mount = tmp_path / "content" / "drive"
    (mount / "MyDrive" / "runs").mkdir(parents=True)
    (mount / "MyDrive" / "runs").chmod(0o700)
    monkeypatch.setattr(colab, "MOUNT_POINT", mount)
    monkeypatch.setattr(colab, "in_colab", lambda: True)
    assert drive_dir("runs/w2v", mount=False) == mount / "MyDrive" / "runs" / "w2v"


# --- Dashboard.save_png ------------------------------------------------------------------------

@pytest.fixture
def dash():
    d = Dashboard(display=False, config=DashboardConfig(mode="text"))
    d.close()
    return d


def test_save_png_replaces_a_planted_link(dash, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("IMPORTANT\n")
    path = tmp_path / "plot.png"
    path.symlink_to(victim)
    assert dash.save_png(path) == str(path)
    assert victim.read_text() == "IMPORTANT\n"
    assert not path.is_symlink() and path.read_bytes().startswith(b"\x89PNG")


def test_save_png_does_not_block_on_a_fifo(dash, tmp_path):
    path = tmp_path / "plot.png"
    os.mkfifo(path)
    try:
        in_time(dash.save_png, path)
    finally:
        unblock(path)
    assert stat.S_ISREG(os.lstat(path).st_mode)


def test_save_png_is_private(dash, tmp_path):
    old = os.umask(0o002)
    try:
        path = dash.save_png(tmp_path / "plot.png")
    finally:
        os.umask(old)
    assert mode(path) == 0o600
