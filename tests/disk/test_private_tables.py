"""Disk-table files are this user's alone: the default folder is checked before a file goes
in, files are made new (0600, never through a link) and used through their descriptor, and
the files of killed processes are removed, never a file a live process holds.

Two users are simulated as root: a folder of another mode, or chowned to another uid.
"""
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from nbtools import CheckpointConfig, CheckpointManager, OffloadedEmbedding
from nbtools import disk
from nbtools.sizing import file_row_bytes
from nbtools.rowfile import RowFile, leftovers, remove_leftovers
from nbtools.rowfile.format import create_exclusive

N, D = 200, 8
OTHER_UID = 12345


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """``tmp_path`` as the system's temporary folder (so the default folder is this test's)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _table(**kw):
    return OffloadedEmbedding(N, D, device="cpu", placement="disk", **kw)


def _bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_default_folder_is_this_users_alone(tmp):
    folder = disk.default_dir()
    assert os.path.dirname(folder) == str(tmp) and not os.path.exists(folder)
    # another user's tables (their own folder, or the one folder all users once shared)
    # lock nobody out
    for theirs in (f"nbtools-tables-{OTHER_UID}", "nbtools-tables"):
        os.mkdir(tmp / theirs, 0o755)
        os.chown(tmp / theirs, OTHER_UID, OTHER_UID)
    t = _table(name="items")
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    path = t.disk.file.path
    assert os.path.dirname(path) == folder
    assert disk.TABLE_FILE.fullmatch(os.path.basename(path))
    assert f"-{os.getpid()}-" in os.path.basename(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    t.close()
    assert os.listdir(folder) == []
    for theirs in (f"nbtools-tables-{OTHER_UID}", "nbtools-tables"):
        assert os.listdir(tmp / theirs) == []


@pytest.mark.parametrize("kind", ["mode 0777", "mode 0755", "other owner", "link", "file"])
def test_an_unsafe_default_folder_is_refused_and_left_untouched(tmp, kind):
    folder = disk.default_dir()
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if kind == "link":
        os.symlink(elsewhere, folder)
    elif kind == "file":
        with open(folder, "wb") as f:
            f.write(b"not a folder")
    else:
        os.mkdir(folder)
        os.chmod(folder, {"mode 0777": 0o777, "mode 0755": 0o755}.get(kind, 0o700))
        if kind == "other owner":
            os.chown(folder, OTHER_UID, OTHER_UID)
    why = {"mode 0777": "open to other users \\(mode 0777\\)",
           "mode 0755": "open to other users \\(mode 0755\\)",
           "other owner": f"owned by another user \\(uid {OTHER_UID}",
           "link": "a symbolic link", "file": "not a folder"}[kind]
    for make in (lambda: _table(name="t"), disk.remove_stale_tables,
                 lambda: file_row_bytes(64, None)):
        with pytest.raises(PermissionError, match=f"{folder}.* is {why}.*disk_dir="):
            make()
    assert os.listdir(elsewhere) == []
    if kind not in ("link", "file"):
        assert os.listdir(folder) == []
    if kind == "file":
        assert _bytes(folder) == b"not a folder"
    # a folder the user names is theirs to choose: used as it is, its new parts made 0700
    shared = tmp / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    t = _table(name="t", disk_dir=str(shared / "a" / "b"))
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o777
    assert [stat.S_IMODE(os.stat(shared / p).st_mode) for p in ("a", "a/b")] == [0o700, 0o700]
    assert stat.S_IMODE(os.stat(t.disk.file.path).st_mode) == 0o600
    t.close()


def test_a_link_planted_at_the_files_name_is_not_followed(tmp, monkeypatch):
    folder = tmp / "tables"
    folder.mkdir()
    victim = tmp / "victim"
    victim.write_bytes(b"precious" * 1000)
    unmade = tmp / "made-through-the-link"        # a link to a file yet to be made, too
    planted = [f"t-{os.getpid()}-{'%016x' % k}.nbrows" for k in range(3)]
    for name, target in zip(planted, (victim, unmade, victim)):
        os.symlink(target, folder / name)
    names = iter(planted)
    monkeypatch.setattr(disk, "file_name", lambda name: next(names))
    with pytest.raises(FileExistsError, match="three fresh file names.*taken"):
        _table(name="t", disk_dir=str(folder))
    assert sorted(os.listdir(folder)) == planted and _bytes(victim) == b"precious" * 1000
    assert not os.path.lexists(unmade)

    names = iter(planted[:1] + ["t-1-00000000000000ff.nbrows"])      # the next one is free
    t = _table(name="t", disk_dir=str(folder))
    assert os.path.basename(t.disk.file.path) == "t-1-00000000000000ff.nbrows"
    init = torch.randn(N, D)
    with torch.no_grad():
        t.weight.copy_(init)
    assert torch.equal(t.weight, init)
    assert os.readlink(folder / planted[0]) == str(victim)
    assert _bytes(victim) == b"precious" * 1000
    t.close()
    # a row file made by name refuses a link there too; overwrite replaces the link itself
    with pytest.raises(FileExistsError, match=planted[0]):
        RowFile.create(folder / planted[0], 10, 8)
    with RowFile.create(folder / planted[0], 10, 8, overwrite=True) as f:
        f.write_range(0, np.ones((10, 8), dtype=np.uint8))
    assert not os.path.islink(folder / planted[0]) and _bytes(victim) == b"precious" * 1000


@pytest.mark.parametrize("swap", ["renamed over", "link to a victim"])
def test_a_swapped_file_is_not_what_the_table_reads_writes_or_removes(tmp, swap):
    """After the table's file is made, its name is given to another file: ``.weight``,
    ``state_dict``, lookups and checkpoints keep using the table's own file, the other one
    is neither changed nor removed when the table closes."""
    t = _table(name="t", disk_dir=str(tmp / "tables"))
    init = torch.randn(N, D)
    with torch.no_grad():
        t.weight.copy_(init)
    path = t.disk.file.path
    size = os.path.getsize(path)
    victim = tmp / "victim"
    victim.write_bytes(os.urandom(size))          # as large: a map of it by name would work
    before = _bytes(victim)
    if swap == "renamed over":
        os.rename(victim, path)
        victim = path
    else:
        os.unlink(path)
        os.symlink(victim, path)
    new = torch.randn(N, D)
    with torch.no_grad():
        t.weight.copy_(new)
    assert torch.equal(t.weight, new)
    assert torch.equal(t.state_dict()["weight"], new)
    ids = torch.tensor([0, 7, N - 1])
    assert torch.equal(t(ids).detach(), new[ids])
    ck = CheckpointManager(tmp / "ck", config=CheckpointConfig(verbose=False))
    ck.save(1, model=t)
    with torch.no_grad():
        t.weight.zero_()
    ck.restore(model=t)
    assert torch.equal(t.weight, new)
    assert _bytes(victim) == before
    t.close()
    assert os.path.lexists(path) and _bytes(victim) == before      # not removed either


_CHILD = """
import sys
from nbtools import OffloadedEmbedding
t = OffloadedEmbedding(64, 8, device="cpu", placement="disk", name=sys.argv[1])
t.weight.data.fill_(1.0)
print(t.disk.file.path, flush=True)
sys.stdin.readline()
"""


def _child(tmp, name):
    """A process whose disk table lives in the default folder of ``tmp`` until its stdin
    closes: (process, its table file)."""
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    return proc


def test_files_of_killed_processes_are_removed_and_no_live_ones(tmp):
    killed, alive = _child(tmp, "killed"), _child(tmp, "alive")
    try:
        killed_file, alive_file = killed.stdout.readline().strip(), alive.stdout.readline().strip()
        assert os.path.dirname(killed_file) == disk.default_dir() == os.path.dirname(alive_file)
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert os.path.exists(killed_file)                  # left behind
        # a new table in the default folder removes it, and says so; the live child's stays
        with pytest.warns(RuntimeWarning, match="removed 1 disk-table file.*killed.*freed"):
            mine = _table(name="mine")
        assert not os.path.exists(killed_file) and os.path.exists(alive_file)
        folder = disk.default_dir()
        # what is not a stale table file of this user's is kept
        others = os.path.join(folder, f"theirs-{os.getpid() + 1}-{'0' * 16}.nbrows")
        with open(others, "wb") as f:
            f.write(b"x" * 4096)
        os.chown(others, OTHER_UID, OTHER_UID)
        notes = os.path.join(folder, "notes.txt")
        with open(notes, "w") as f:
            f.write("mine")
        link = os.path.join(folder, f"link-1-{'1' * 16}.nbrows")
        os.symlink(notes, link)
        assert disk.remove_stale_tables() == []
        alive.send_signal(signal.SIGKILL)
        alive.wait(30)
        [gone] = disk.remove_stale_tables()
        assert gone["path"] == alive_file and gone["bytes"] > 0
        assert sorted(os.listdir(folder)) == sorted(
            os.path.basename(p) for p in (others, notes, link, mine.disk.file.path))
        mine.close()
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(30)


def test_a_held_file_is_kept_whatever_its_name_says(tmp_path, monkeypatch):
    """The lock, not the pid in a name, tells a live file: one named after a process that
    is gone is kept while held, removed once its last descriptor closes; one written on
    another machine (a folder shared over the network) is kept."""
    dead_pid = 2 ** 22 + 17                  # above pid_max's default: no such process
    held = str(tmp_path / f"held-{dead_pid}-{'a' * 16}.nbrows")
    fd = create_exclusive(held)
    os.write(fd, b"rows")
    try:
        assert disk.remove_stale_tables(tmp_path) == []
    finally:
        os.close(fd)
    assert [r["path"] for r in disk.remove_stale_tables(tmp_path)] == [held]
    monkeypatch.setattr(socket, "gethostname", lambda: "another-machine")
    remote = tmp_path / f"remote-{dead_pid}-{'b' * 16}.nbrows"
    RowFile.create(remote, 4, 8).close()
    with RowFile.create(tmp_path / "open.nbrows", 4, 8) as f:
        monkeypatch.undo()
        assert disk.remove_stale_tables(tmp_path) == [] and remote.exists()
        # its header names a writer on another machine, so it seems dead by pid: held
        assert leftovers(tmp_path) == [] and remove_leftovers(tmp_path) == 0
        assert os.path.exists(f.path)
