"""nbtools.colab (Drive folder, mounting, with a fake google.colab) and the checkpoint mirror
(nbtools.checkpoint.DriveSync: background atomic copies)."""
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from nbtools import colab
from nbtools.checkpoint import CheckpointConfig, CheckpointManager, DriveSync, copy_checkpoint
from nbtools.colab import DriveError, drive_dir

QUIET = CheckpointConfig(verbose=False, progress=False, chunk_bytes=4096, file_bytes=8192)


def test_drive_dir_outside_colab(tmp_path, monkeypatch):
    monkeypatch.setattr(colab, "in_colab", lambda: False)
    assert drive_dir("a/b", root=tmp_path) == tmp_path / "a" / "b" and (tmp_path / "a/b").is_dir()
    monkeypatch.setenv("NBTOOLS_DRIVE_DIR", str(tmp_path / "env"))
    assert drive_dir("x") == tmp_path / "env" / "x"


@pytest.fixture
def fake_colab(tmp_path, monkeypatch):
    """google.colab.drive that 'mounts' a directory and records flush_and_unmount."""
    calls = []
    mount_point = tmp_path / "content" / "drive"

    def mount(path):
        calls.append(("mount", path))
        (mount_point / "MyDrive").mkdir(parents=True, exist_ok=True)

    drive = types.SimpleNamespace(mount=mount,
                                  flush_and_unmount=lambda: calls.append(("flush_and_unmount",)))
    google = types.ModuleType("google")
    colab_mod = types.ModuleType("google.colab")
    colab_mod.drive = drive
    google.colab = colab_mod
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab_mod)
    monkeypatch.setattr(colab, "MOUNT_POINT", mount_point)
    monkeypatch.setattr(colab, "in_colab", lambda: True)
    return mount_point, calls


def test_drive_dir_mounts_in_colab(fake_colab):
    mount_point, calls = fake_colab
    with pytest.raises(DriveError, match="not mounted"):
        drive_dir("runs", mount=False)
    path = drive_dir("runs/w2v")
    assert path == mount_point / "MyDrive" / "runs" / "w2v" and path.is_dir()
    assert calls == [("mount", str(mount_point))]
    drive_dir("other")
    assert len(calls) == 1                          # mounted once


def test_finalize_flushes_drive_in_colab(fake_colab, tmp_path):
    mount_point, calls = fake_colab
    ck = CheckpointManager(tmp_path / "local", keep=2, mirror=drive_dir("runs"), config=QUIET)
    ck.save(1, x={"w": torch.arange(100.0)})
    ck.finalize()
    assert calls[-1] == ("flush_and_unmount",)
    assert (mount_point / "MyDrive" / "runs" / "step-000000001" / "MANIFEST").exists()


def _checkpoint(root, step, value=1.0):
    ck = CheckpointManager(root, keep=10, config=QUIET)
    return ck.save(step, x={"w": torch.full((3000,), value)})["path"]


def test_copy_never_renames_across_filesystems(tmp_path, monkeypatch):
    """Drive refuses renames from local disk (EXDEV): the copy renames only inside the target."""
    src = _checkpoint(tmp_path / "local", 3)
    target = tmp_path / "drive"
    real_rename = os.rename

    def fuse_rename(a, b):
        if os.path.dirname(os.path.abspath(a)) != os.path.dirname(os.path.abspath(b)):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", fuse_rename)
    final = copy_checkpoint(src, target)
    assert final == target / "step-000000003"
    assert sorted(p.name for p in target.iterdir()) == ["step-000000003"]
    got = {}
    assert CheckpointManager(target, config=QUIET).restore(x=got) == 3


def test_background_copies_newest_and_reports_errors(tmp_path):
    paths = [_checkpoint(tmp_path / "local", s, float(s)) for s in (1, 2, 3)]
    sync = DriveSync(tmp_path / "drive")
    gate = threading.Event()
    sync.after_copy = gate.wait                     # hold the worker after its first copy
    for p in paths:
        sync.submit(p)
    assert set(map(str, sync.pending())) >= {paths[-1]}
    gate.set()
    sync.wait(timeout=30)
    copied = {os.path.basename(c["path"]) for c in sync.copied}
    assert "step-000000003" in copied               # the newest always arrives
    assert len(sync.copied) + len(sync.skipped) == 3
    sync.after_copy = None
    sync.submit(tmp_path / "local" / "missing")     # fails in the background ...
    with pytest.raises(DriveError, match="failed"):
        sync.wait(timeout=30)                       # ... and says so
    sync.submit(tmp_path / "local" / "missing")
    while sync.pending():
        time.sleep(0.01)
    with pytest.warns(RuntimeWarning, match="local copy is intact"):
        sync.submit(paths[0])                       # the next submit warns about it
    sync.wait(timeout=30)                           # reported once, not again


# --- the notebooks' install cell ------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
# a release tag or a full commit id: what "pinned" means for an install from the repository
PINNED = (re.escape(colab.DISTRIBUTION) + r"(\[[\w,]+\])? @ git\+" + re.escape(colab.REPO_URL)
          + r"@(v\d+(\.\d+)*|[0-9a-f]{40})\b")


def _install_cells():
    cells = {}
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(p.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        cells[p.name] = "".join(code[0]["source"])
    return cells


def _cell():
    cells = _install_cells()
    assert len(cells) == 4 and len(set(cells.values())) == 1, "the four install cells differ"
    return next(iter(cells.values()))


def test_install_pins_this_version_s_release_tag():
    import nbtools
    assert colab.RELEASE == f"v{nbtools.__version__}"
    assert colab.INSTALL_SPEC == ("nbtools-offload[notebook] @ "
                                  f"git+https://github.com/nbtools-dev/nbtools@v{nbtools.__version__}")
    assert colab.INSTALL_LINE == f'%pip install -q "{colab.INSTALL_SPEC}"'
    assert re.fullmatch(PINNED, colab.INSTALL_SPEC)
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version and version.group(1) == nbtools.__version__


def test_cell_readme_and_docs_say_the_same_install():
    cell = _cell()
    assert f'SPEC = "{colab.INSTALL_SPEC}"' in cell
    assert '[sys.executable, "-m", "pip", "install", "-q", SPEC]' in cell
    for doc in ("README.md", "docs/notebooks.md"):
        assert colab.INSTALL_LINE in (ROOT / doc).read_text(), f"{doc} does not quote the line"


def _unpinned(text):
    """Lines that install nbtools by a name a package index resolves, or that ask an index."""
    bad = []
    for line in text.splitlines():
        if re.search(r"""pip["',\s]+index""", line):      # `pip index` or [..., "pip", "index"]
            bad.append(line)
            continue
        named = [m.start() for m in re.finditer(re.escape(colab.DISTRIBUTION) + r"\[", line)]
        if "pip install" in line and colab.DISTRIBUTION in line:
            named.append(line.index(colab.DISTRIBUTION))
        if any(not re.match(PINNED, line[i:]) for i in named):
            bad.append(line)
    return bad


def test_the_unpinned_check_catches_the_old_forms():
    for line in ['%pip install -q "nbtools-offload[notebook]"',
                 '    %pip install -q "nbtools-offload[notebook] @ git+https://github.com/nbtools-dev/nbtools"',
                 "pip install 'nbtools-offload[cupy]'",
                 "pip install -U nbtools-offload==0.1.0",
                 'subprocess.run([sys.executable, "-m", "pip", "index", "versions", "nbtools-offload"])',
                 'SPEC = "nbtools-offload[notebook] @ git+https://github.com/nbtools-dev/nbtools@main"']:
        assert _unpinned(line) == [line], line
    assert _unpinned(colab.INSTALL_LINE) == []
    assert _unpinned(f"pip install '{colab.DISTRIBUTION}[dev] @ git+{colab.REPO_URL}@{'0' * 40}'") == []
    assert _unpinned('name = "nbtools-offload"  # the distribution is nbtools-offload') == []


def test_nothing_installs_nbtools_by_an_unpinned_name():
    files = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "environment.yml",
             *(ROOT / "docs").rglob("*.md"), *(ROOT / "notebooks").glob("*.ipynb"),
             *(ROOT / "nbtools").rglob("*.py"), *(ROOT / "scripts").rglob("*.sh"),
             *(p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".sh", ".md"))]
    assert len(files) > 50
    found = {}
    for path in files:
        text = path.read_text(errors="replace")
        if path.suffix == ".ipynb":                 # the cells' code, not the JSON escaping
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        if bad := _unpinned(text):
            found[str(path.relative_to(ROOT))] = bad
    assert not found, f"installs by an unpinned name or an index lookup: {found}"


def _run_cell(tmp_path, *, pip_exit, cwd=None):
    """The install cell as a fresh runtime runs it: nbtools not importable (python -S: no
    site-packages), and `python -m pip` is a fake that records its arguments and either fails
    like pip or 'installs' nbtools by linking the package into the fake site directory."""
    fake = tmp_path / "site"
    (fake / "pip").mkdir(parents=True)
    (fake / "pip" / "__init__.py").write_text("")
    (fake / "pip" / "__main__.py").write_text(textwrap.dedent(f"""\
        import os, sys
        with open({str(tmp_path / "pip-args")!r}, "w") as f:
            f.write("\\n".join(sys.argv[1:]))
        if {pip_exit}:
            print("Collecting nbtools-offload ...")
            sys.stderr.write("ERROR: Could not resolve host: github.com\\n")
            sys.exit({pip_exit})
        os.symlink({str(ROOT / "nbtools")!r}, {str(fake / "nbtools")!r})
        """))
    cwd = cwd or tmp_path / "content"
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(fake)}
    out = subprocess.run([sys.executable, "-S", "-c", _cell()], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)
    args = tmp_path / "pip-args"
    return out, args.read_text().splitlines() if args.exists() else None


def test_install_cell_stops_with_one_clear_message_when_pip_fails(tmp_path):
    out, args = _run_cell(tmp_path, pip_exit=1)
    assert args == ["install", "-q", colab.INSTALL_SPEC]
    assert out.returncode != 0, out.stdout
    error = out.stderr.strip().splitlines()
    message = out.stderr[out.stderr.index("RuntimeError: "):]
    assert message.startswith(f"RuntimeError: pip could not install {colab.INSTALL_SPEC} "
                              "(exit status 1):"), out.stderr
    assert "ERROR: Could not resolve host: github.com" in message          # what pip said
    assert "reaches github.com" in message and 'pip install -e ".[notebook]"' in error[-1]
    assert out.stdout == f'pip install "{colab.INSTALL_SPEC}"\n'            # and nothing after


def test_install_cell_installs_then_says_what_it_installed(tmp_path):
    import nbtools
    out, args = _run_cell(tmp_path, pip_exit=0)
    assert out.returncode == 0, out.stderr
    assert args == ["install", "-q", colab.INSTALL_SPEC]
    lines = out.stdout.splitlines()
    assert lines[0] == f'pip install "{colab.INSTALL_SPEC}"'
    assert lines[-1].startswith(f"nbtools {nbtools.__version__} from ")   # colab.installed()


def test_install_cell_installs_nothing_inside_a_checkout(tmp_path):
    checkout = tmp_path / "clone"
    checkout.mkdir()
    (checkout / "nbtools").symlink_to(ROOT / "nbtools")
    out, args = _run_cell(tmp_path, pip_exit=1, cwd=checkout / "notebooks")
    assert out.returncode == 0, out.stderr
    assert args is None                                                    # pip never ran
    assert out.stdout.startswith("nbtools ") and "pip install" not in out.stdout


# --- what colab.installed() reports -----------------------------------------------------------------

def _fake_install(tmp_path, direct_url=None, *, metadata=True):
    """A site directory holding an nbtools package and, optionally, the distribution's
    metadata as pip writes it (direct_url.json: PEP 610)."""
    site = tmp_path / "site-packages"
    (site / "nbtools").mkdir(parents=True)
    if metadata:
        info = site / "nbtools_offload-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nbtools-offload\n"
                                       "Version: 0.1.0\n")
        if direct_url is not None:
            (info / "direct_url.json").write_text(json.dumps(direct_url))
    return site / "nbtools"


def test_installed_reports_the_ref_and_commit_pip_recorded(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    package = _fake_install(tmp_path, {
        "url": "https://github.com/nbtools-dev/nbtools",
        "vcs_info": {"vcs": "git", "requested_revision": "v0.1.0", "commit_id": commit}})
    assert colab.installed(package) == ("nbtools 0.1.0 from git+https://github.com/nbtools-dev/"
                                        f"nbtools@v0.1.0 (commit {commit})")


def test_installed_says_when_no_commit_was_recorded(tmp_path):
    archive = _fake_install(tmp_path / "a", {"url": "file:///tmp/nbtools_offload-0.1.0.tar.gz",
                                             "archive_info": {}})
    assert colab.installed(archive) == ("nbtools 0.1.0 from file:///tmp/nbtools_offload-0.1.0"
                                        ".tar.gz (not a repository: no commit recorded)")
    by_name = colab.installed(_fake_install(tmp_path / "b"))              # no direct_url.json
    assert by_name.startswith("nbtools 0.1.0 at ") and "no commit to report" in by_name
    assert colab.INSTALL_LINE in by_name
    bare = colab.installed(_fake_install(tmp_path / "c", metadata=False))
    assert "not an installed distribution, not a git checkout" in bare


def test_installed_reports_a_checkouts_commit(tmp_path):
    import nbtools
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "clone"
    (repo / "nbtools").mkdir(parents=True)
    (repo / "nbtools" / "__init__.py").write_text("")

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                               *args], check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    git("add", "nbtools")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD")
    want = f"nbtools {nbtools.__version__} from the git checkout at {repo.resolve()} (commit {head}"
    assert colab.installed(repo / "nbtools") == want + ")"
    (repo / "nbtools" / "__init__.py").write_text("x = 1\n")
    assert colab.installed(repo / "nbtools") == want + ", with uncommitted changes)"


def test_installed_reports_the_commit_a_copied_tree_names(tmp_path, monkeypatch):
    """A machine sent a copy of the working tree (whose git state is not the commit's) is told
    the commit through NBTOOLS_COMMIT, and reports that one."""
    import nbtools
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "copy"
    (repo / "nbtools").mkdir(parents=True)
    (repo / "nbtools" / "__init__.py").write_text("")
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    monkeypatch.setenv("NBTOOLS_COMMIT", "0123abc")
    assert colab.installed(repo / "nbtools") == (
        f"nbtools {nbtools.__version__} from the git checkout at {repo.resolve()} "
        "(commit 0123abc (NBTOOLS_COMMIT))")


def test_describe_shows_what_is_installed():
    import io

    import nbtools
    out = io.StringIO()
    info = nbtools.describe(file=out)
    assert info["nbtools"] == colab.installed()
    assert out.getvalue().splitlines()[0] == info["nbtools"]


def test_badges_name_the_repository_the_install_comes_from():
    assert colab.INSTALL_SPEC.split(" @ git+", 1)[1].startswith(colab.REPO_URL + "@")
    for path in [ROOT / "README.md", *sorted((ROOT / "notebooks").glob("*.ipynb"))]:
        text = path.read_text()
        for url in re.findall(r"https://colab\.research\.google\.com/github/[^)\s\"\\]+", text):
            name = url.rsplit("/", 1)[-1]
            assert url == colab.badge_url(name), f"{path.name}: {url}"
