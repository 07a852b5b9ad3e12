"""The documents a user reads: links that lead somewhere, no experiments cited by commit, and a
getting-started page whose first example runs as pasted."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GETTING_STARTED = ROOT / "docs" / "getting-started.md"

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"```.*?```", re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _relative_links(path: pathlib.Path):
    """``(target, anchor)`` of every link in ``path`` that is not a URL (code blocks left out)."""
    text = _FENCE.sub("", path.read_text())
    for m in _LINK.finditer(text):
        link = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", link):          # https:, mailto:, ...
            continue
        target, _, anchor = link.partition("#")
        yield target, anchor


def test_the_link_check_sees_links():
    links = [t for t, _ in _relative_links(ROOT / "README.md")]
    assert "docs/getting-started.md" in links and "docs/README.md" in links


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_in_the_repository(doc):
    broken = []
    for target, anchor in _relative_links(doc):
        dest = (doc.parent / target).resolve() if target else doc
        if not dest.exists() or ROOT not in dest.parents:
            broken.append(f"{target}#{anchor}" if anchor else target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}#{anchor} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)} links to what is not there: {broken}"


def test_no_experiment_is_cited_by_commit():
    """Code and docs give the reason or a benchmarks/RESULTS.md section, never a probe in git
    history (``git show <commit>:path``): a user cannot follow that."""
    needle = "git " + "show"                               # not this file's own hit
    found = [f"{p.relative_to(ROOT)}:{i}"
             for folder in ("nbtools", "docs")
             for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".md")
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if needle in line]
    found += [f"README.md:{i}" for i, line in
              enumerate((ROOT / "README.md").read_text().splitlines(), 1) if needle in line]
    assert not found, found


def _getting_started_examples():
    blocks = re.findall(r"```python\n(.*?)```", GETTING_STARTED.read_text(), re.S)
    return [b for b in blocks if not b.lstrip().startswith("%pip")]


def test_getting_started_quotes_the_install_line():
    from nbtools import colab
    assert colab.INSTALL_LINE in GETTING_STARTED.read_text()


def test_getting_started_first_table_runs_as_pasted(tmp_path):
    """The page's check of the machine, its first table and its checkpoint block, in a fresh
    interpreter (one thread, CPU): they run and the loss falls."""
    examples = _getting_started_examples()
    assert "OffloadedEmbedding(200_000" in examples[1]
    assert "CheckpointManager" in examples[2]
    code = "\n".join(examples[:3])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], out.stdout
    assert (tmp_path / "checkpoints" / "first" / "step-000000020").is_dir()
