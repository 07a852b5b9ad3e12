"""Colab and Google Drive: installing nbtools, a folder that outlives the runtime, and forcing
Drive to upload.

The notebooks' first cell installs :data:`INSTALL_SPEC`: the project's repository at the release
tag of this version, so what runs is what the project released and never whatever a package
index holds under a name. :func:`installed` says which nbtools is in use: version and commit.

Drive in Colab is a FUSE mount that uploads late: after a disconnect, files written shortly
before can be missing or empty, and ``os.replace`` from local disk into the mount fails (EXDEV).
So nbtools writes checkpoints to local disk first and mirrors each finished one into the Drive
folder (:class:`nbtools.checkpoint.DriveSync`: temporary name, fsync, rename *inside* the Drive
folder); :func:`flush_drive` (``drive.flush_and_unmount()``) at the end forces the upload.

Outside Colab the same calls work on plain directories (``~/nbtools-drive`` by default, or
``$NBTOOLS_DRIVE_DIR``), so everything here is testable on any machine.

>>> import tempfile
>>> d = drive_dir("runs/demo", root=tempfile.mkdtemp())
>>> d.is_dir()
True
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path, PurePath

from . import NbtoolsError, __version__
from .files import file_kind, make_folder, open_regular

MOUNT_POINT = Path("/content/drive")          # where Colab mounts Google Drive
# The repository the notebooks' Colab badges open, and the only place installs come from.
REPO_URL = "https://github.com/nbtools-dev/nbtools"
DISTRIBUTION = "nbtools-offload"      # the distribution's name (nbtools is another project's)
# Each release is tagged v<version> in REPO_URL. The install pins that tag: the project publishes
# nothing on a package index, so a lookup by name there would get whatever someone registered.
RELEASE = f"v{__version__}"
INSTALL_SPEC = f"{DISTRIBUTION}[notebook] @ git+{REPO_URL}@{RELEASE}"
# The one install line: README.md and docs/notebooks.md quote it, the notebooks' first cell runs
# INSTALL_SPEC (tests/test_colab.py keeps the four in step).
INSTALL_LINE = f'%pip install -q "{INSTALL_SPEC}"'
MY_DRIVE = "MyDrive"


class DriveError(NbtoolsError, RuntimeError):
    """Drive could not be mounted, or a background copy to it failed."""


def in_colab() -> bool:
    """True inside a Google Colab runtime.

    >>> isinstance(in_colab(), bool)
    True
    """
    if "google.colab" in sys.modules or os.environ.get("COLAB_RELEASE_TAG"):
        return True
    try:
        return importlib.util.find_spec("google.colab") is not None
    except (ImportError, ValueError):
        return False


def _mount() -> None:
    from google.colab import drive   # only exists in Colab

    drive.mount(str(MOUNT_POINT))


def drive_dir(subdir: str = "nbtools", *, mount: bool = True, root=None) -> Path:
    """A directory that survives a new runtime: on Google Drive in Colab, local elsewhere.

    Args:
        subdir: path below My Drive (Colab) or below ``root`` (elsewhere); the folders missing
            are made (mode 0700: yours alone).
        mount: in Colab, mount Drive at /content/drive when it is not mounted yet (asks for
            permission once). With ``mount=False`` an unmounted Drive is an error.
        root: the base directory outside Colab; default ``$NBTOOLS_DRIVE_DIR`` or
            ``~/nbtools-drive``. Ignored in Colab.

    The root (My Drive, ``root``, ``$NBTOOLS_DRIVE_DIR``) is your choice and may be a symbolic
    link. Below it the root may be a place others write to (a lab server's shared folder), so a
    folder of ``subdir`` that is already there must be an ordinary folder of yours that only you
    can write to: a symbolic link, a folder of another user, or one that group or others may
    write to is refused (:class:`DriveError`), as writing there would hand your checkpoints to
    whoever controls it. Drive's FUSE mount in Colab shows every folder as yours, mode 0700, so
    this never refuses a folder of My Drive for its owner or mode.

    Returns:
        ``pathlib.Path`` of the directory.
    """
    if in_colab():
        base = MOUNT_POINT / MY_DRIVE
        if not base.is_dir():
            if not mount:
                raise DriveError(f"Google Drive is not mounted at {MOUNT_POINT}; call "
                                 "drive_dir(..., mount=True) or run "
                                 "`from google.colab import drive; drive.mount('/content/drive')`")
            _mount()
            if not base.is_dir():
                raise DriveError(f"mounting Google Drive did not create {base}; check the "
                                 "authorisation prompt in the cell output and run again")
    else:
        base = Path(root or os.environ.get("NBTOOLS_DRIVE_DIR") or "~/nbtools-drive").expanduser()
        make_folder(str(base))
    parts = PurePath(subdir).parts
    if PurePath(subdir).is_absolute() or ".." in parts:
        raise DriveError(f"drive_dir({subdir!r}): name a folder below {base} (a relative path "
                         "without '..'); pass root= to choose another base")
    path = base
    for part in parts:
        path = path / part
        try:
            make_folder(str(path))
        except FileExistsError:
            pass                             # a link to nothing, a file: said below
        _own_private_folder(path, base)
    return path


def _own_private_folder(path: Path, base: Path) -> None:
    """Raise :class:`DriveError` unless ``path`` (below ``base``) is a folder, not a symbolic
    link, owned by this user and not writable by others. (A folder its group may write is
    accepted: with a group of one's own, the default on many Linux machines under umask 002,
    that is the user alone.)"""
    st = os.lstat(path)
    elsewhere = ("Remove or rename it, or choose a folder of your own: another subdir, or "
                 "another root (root=... or $NBTOOLS_DRIVE_DIR)")
    if stat.S_ISLNK(st.st_mode):
        raise DriveError(f"{path} below {base} is a symbolic link (to "
                         f"{os.path.realpath(path)}): nbtools does not write through a link "
                         f"below the root, which someone else may have put there. {elsewhere}; "
                         "if you made the link, pass the folder it names as the root")
    if not stat.S_ISDIR(st.st_mode):
        raise DriveError(f"{path} below {base} is {file_kind(st.st_mode)}, not a folder. "
                         f"{elsewhere}")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise DriveError(f"{path} below {base} belongs to another user (uid {st.st_uid}): "
                         f"what nbtools wrote there would be theirs to read and replace. "
                         f"{elsewhere}")
    if st.st_mode & stat.S_IWOTH:
        raise DriveError(f"{path} below {base} may be written by others (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}): anyone who can write there could "
                         f"replace what nbtools writes. Run `chmod o-w {path}` if it is meant "
                         f"to be yours; else: {elsewhere}")


def flush_drive(unmount: bool = True) -> None:
    """Force Drive to upload what was written (Colab: ``drive.flush_and_unmount()``, which also
    unmounts; elsewhere: ``os.sync()``)."""
    if in_colab() and MOUNT_POINT.joinpath(MY_DRIVE).is_dir():
        from google.colab import drive

        if unmount:
            drive.flush_and_unmount()
            return
    if hasattr(os, "sync"):
        os.sync()


def installed(package=None) -> str:
    """Which nbtools is in use and where it came from, for the record: version and commit.

    An install from the repository reports the ref and commit pip recorded for it (PEP 610's
    ``direct_url.json``); a git checkout reports its HEAD commit; an install from anywhere else
    says that no commit was recorded.

    ``package`` may be a copy someone else handed over (a shared Drive folder, a lab server), so
    what is there is read as data and nothing there runs: the distribution's metadata and
    ``direct_url.json`` are read only if they are regular files, up to a size cap, and one that
    is malformed counts as no record; the commit is read from ``.git/HEAD`` and the ref's file
    (or ``packed-refs``), never asked of git. The note on uncommitted changes needs git, and a
    repository's own configuration names commands git runs (``core.fsmonitor``, hooks, filter
    drivers...): so git is run only for a checkout that belongs to this user, and then with a
    git folder of nbtools' own (HEAD, a copy of the index, the repository's objects by
    reference, an empty configuration), so the repository's configuration is never read. For
    a checkout of another user no such check is made, and the line says so.

    Args:
        package: the ``nbtools`` package directory to report on; default the one imported.

    Returns:
        One line, e.g. ``nbtools 0.2.0 from git+https://github.com/nbtools-dev/nbtools@v0.2.0
        (commit 0123abc...)``; it never raises for an odd install, it says what it could read.

    >>> installed().startswith(f"nbtools {__version__} from ")
    True
    """
    package = Path(package or Path(__file__).parent).resolve()
    root = package.parent
    recorded = _recorded_install(root)
    if recorded is not None:
        version, origin = recorded
        if origin is not None:
            return f"nbtools {version} from {origin}"
    if os.path.lexists(root / ".git"):
        return f"nbtools {__version__} from the git checkout at {root} ({_git_commit(root)})"
    if recorded is not None:
        return (f"nbtools {version} at {root}, installed without a recorded source (e.g. by "
                f"name from a package index): no commit to report; {INSTALL_LINE} installs "
                "the pinned release")
    return f"nbtools {__version__} from {root} (not an installed distribution, not a git checkout)"


def _read_data(path, cap: int, *, whole: bool = True):
    """The bytes of the regular file ``path`` (a link is followed: the files read here are
    data, never written), or None when there is none, it is not a regular file, it cannot be
    read, or (``whole``) it is larger than ``cap``; with ``whole=False``, its first ``cap``
    bytes."""
    try:
        fd = open_regular(path, follow=True, what="metadata file")
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        return None
    if len(data) > cap:
        return None if whole else data[:cap]
    return data


_METADATA_CAP = 256 << 10        # the headers come first; a long description may follow
_DIRECT_URL_CAP = 64 << 10
_GIT_FILE_CAP = 4 << 10          # HEAD, a ref
_PACKED_REFS_CAP = 16 << 20
_INDEX_CAP = 256 << 20


def _recorded_install(site: Path):
    """(version, where from) of the distribution installed in ``site``, or None when there is
    none; where from is None when pip recorded no source (an install from a package index) or
    its record cannot be read."""
    want = re.sub(r"[-_.]+", "_", DISTRIBUTION).lower()
    try:
        names = sorted(os.listdir(site))
    except OSError:
        return None
    for name in names:
        stem, dot, kind = name.rpartition(".")
        if kind not in ("dist-info", "egg-info") or not dot:
            continue
        if re.sub(r"[-_.]+", "_", stem.split("-")[0]).lower() != want:
            continue
        info = site / name
        meta = _read_data(info / ("METADATA" if kind == "dist-info" else "PKG-INFO"),
                          _METADATA_CAP, whole=False)
        if meta is None:
            continue
        version = _header(meta, "Version") or (stem.split("-") + ["unknown"])[1]
        if kind == "dist-info":
            return version, _direct_url(_read_data(info / "direct_url.json", _DIRECT_URL_CAP))
        return version, None
    return None


def _header(meta: bytes, key: str):
    """The value of the header ``key`` of a METADATA / PKG-INFO text, or None."""
    for line in meta.decode("utf-8", "replace").splitlines():
        if not line.strip():
            break                                    # the headers end at the first blank line
        name, colon, value = line.partition(":")
        if colon and name.strip().lower() == key.lower() and value.strip():
            return value.strip()[:100]
    return None


def _direct_url(raw):
    """Where from, as PEP 610's ``direct_url.json`` (``raw``) says; None when it says nothing
    readable."""
    try:
        direct = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(direct, dict) or not isinstance(direct.get("url"), str):
        return None
    url = direct["url"]
    vcs = direct.get("vcs_info")
    if vcs is None:
        return f"{url} (not a repository: no commit recorded)"
    if not isinstance(vcs, dict):
        return None
    text = {k: vcs.get(k) for k in ("vcs", "requested_revision", "commit_id")}
    if not all(v is None or isinstance(v, str) for v in text.values()):
        return None
    ref = f"@{text['requested_revision']}" if text["requested_revision"] else ""
    return (f"{text['vcs'] or 'git'}+{url}{ref} "
            f"(commit {text['commit_id'] or 'not recorded'})")


_GIT_CONFIG = "[core]\n\trepositoryformatversion = 0\n\tbare = false\n"
_GIT_CONFIG_SHA256 = ("[core]\n\trepositoryformatversion = 1\n\tbare = false\n"
                      "[extensions]\n\tobjectformat = sha256\n")
_COMMIT = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")
_REF = re.compile(r"refs/[A-Za-z0-9._/-]+")


def _git_commit(root: Path) -> str:
    """``commit <HEAD>``, with a note when tracked files differ from it; where the variable
    ``NBTOOLS_COMMIT`` names a commit (a copy of a checkout whose own git state is not that
    commit's, as on a machine that is sent the working tree), that commit. See
    :func:`installed` for what is read and what runs."""
    named = os.environ.get("NBTOOLS_COMMIT", "").strip()
    if named:
        return f"commit {named} (NBTOOLS_COMMIT)"
    git_dir = root / ".git"
    head = _head_commit(git_dir)
    if not _COMMIT.fullmatch(head):
        return f"commit unknown: {head}"
    try:
        mine = all(os.lstat(p).st_uid == os.getuid() for p in (root, git_dir))
    except (OSError, AttributeError):
        mine = False
    if not mine:
        return f"commit {head}; not checked for uncommitted changes (the checkout is not yours)"
    dirty = _uncommitted(root, git_dir, head)
    if dirty is None:
        return f"commit {head}; uncommitted changes unknown"
    return f"commit {head}{', with uncommitted changes' if dirty else ''}"


def _head_commit(git_dir: Path) -> str:
    """The commit ``git_dir``'s HEAD names, read as data; else why not, in words."""
    if not git_dir.is_dir():
        return f"{git_dir} is not a folder (a worktree or submodule?); set NBTOOLS_COMMIT"
    head = _read_data(git_dir / "HEAD", _GIT_FILE_CAP)
    if head is None:
        return f"no readable {git_dir / 'HEAD'}"
    head = head.decode("ascii", "replace").strip()
    if _COMMIT.fullmatch(head):
        return head                                               # a detached HEAD
    ref = head.removeprefix("ref:").strip()
    if not head.startswith("ref:") or not _REF.fullmatch(ref) or ".." in ref:
        return f"{git_dir / 'HEAD'} names no branch"
    loose = _read_data(git_dir / ref, _GIT_FILE_CAP)
    if loose is not None and _COMMIT.fullmatch(loose.decode("ascii", "replace").strip()):
        return loose.decode("ascii").strip()
    packed = _read_data(git_dir / "packed-refs", _PACKED_REFS_CAP) or b""
    for line in packed.decode("ascii", "replace").splitlines():
        commit, _, name = line.partition(" ")
        if name.strip() == ref and _COMMIT.fullmatch(commit):
            return commit
    return f"{ref} has no commit yet"


def _uncommitted(root: Path, git_dir: Path, head: str):
    """Whether tracked files of the checkout ``root`` differ from ``head`` (None: unknown), by
    ``git status`` run with a git folder of nbtools' own: the repository's configuration,
    hooks and attributes file are never read, so nothing they name runs."""
    index = _read_data(git_dir / "index", _INDEX_CAP)
    objects = git_dir / "objects"
    if index is None or not objects.is_dir() or shutil.which("git") is None:
        return None
    own = tempfile.mkdtemp(prefix="nbtools-git-")
    try:
        for folder in ("objects/info", "refs"):
            os.makedirs(os.path.join(own, folder), 0o700)
        for name, data in (("HEAD", f"{head}\n"), ("index", index),
                           ("objects/info/alternates", f"{objects.resolve()}\n"),
                           ("config", _GIT_CONFIG if len(head) == 40 else _GIT_CONFIG_SHA256)):
            with open(os.path.join(own, name), "wb") as f:
                f.write(data if isinstance(data, bytes) else data.encode())
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env.update(GIT_DIR=own, GIT_WORK_TREE=str(root), GIT_CONFIG_NOSYSTEM="1",
                   GIT_CONFIG_GLOBAL=os.devnull, GIT_TERMINAL_PROMPT="0", GIT_PAGER="cat")
        status = subprocess.run(
            ["git", "-c", "core.fsmonitor=false", "-c", f"core.hooksPath={os.devnull}",
             "-c", f"core.attributesFile={os.devnull}", "--no-optional-locks",
             "status", "--porcelain", "--untracked-files=no", "--ignore-submodules"],
            cwd=own, env=env, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        shutil.rmtree(own, ignore_errors=True)
    if status.returncode != 0:
        return None
    return bool(status.stdout.strip())


def badge_url(notebook: str) -> str:
    """The Colab link that opens ``notebooks/<notebook>`` of :data:`REPO_URL`."""
    repo = REPO_URL.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{repo}/blob/main/notebooks/{notebook}"
