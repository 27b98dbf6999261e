"""The repository stands alone: no pointer to notes outside it, every cited fact exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FACTS = (ROOT / "docs" / "facts.md").read_text()
# Documents that were never part of this repository; citing them sends a reader nowhere.
OUTSIDE = re.compile(r"DESIGN\.md|nvml-systemd-facts|\.\./shared|research notes")
CITATION = re.compile(r"facts\.md\s+§(\d+(?:\.\d+)?)")


def _tracked_text_files() -> list[Path]:
    """The checkout's text files, from git: skipped (saying why) without git or a checkout.

    ``safe.directory`` names the checkout, so root may read a clone another user owns (git
    otherwise refuses it as of "dubious ownership").
    """
    if shutil.which("git") is None:
        pytest.skip("needs git (apt-get install git) to list the checkout's files")
    listed = subprocess.run(
        ["git", "-c", f"safe.directory={ROOT}", "ls-files", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    names = listed.stdout.split(b"\0")
    paths = [ROOT / name.decode() for name in names if name]
    return [
        p for p in paths if p.suffix in {".py", ".md", ".c", ".toml", ".conf", ""} and p.is_file()
    ]


def _sections() -> set[str]:
    """The section numbers facts.md defines: ``## N.`` headings, bold ``**N.M …**`` paragraphs."""
    numbers = set(re.findall(r"^## (\d+)\.", FACTS, re.MULTILINE))
    numbers |= set(re.findall(r"^\*\*(\d+\.\d+) ", FACTS, re.MULTILINE))
    return numbers


def test_nothing_points_outside_the_repository() -> None:
    """No code, test or doc names DESIGN.md, the research notes or ../shared."""
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in _tracked_text_files()
        if path.name != Path(__file__).name
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert offenders == []


def test_every_cited_fact_has_its_section() -> None:
    """Each ``docs/facts.md §N`` in the tree names a section that facts.md has."""
    sections = _sections()
    assert {"1", "1.8", "2.4", "4.1", "4.7", "7"} <= sections  # a positive control
    cited = {
        (str(path.relative_to(ROOT)), number)
        for path in _tracked_text_files()
        for number in CITATION.findall(path.read_text(errors="replace"))
    }
    assert cited, "no citation found: the pattern is wrong"
    assert [c for c in cited if c[1] not in sections] == []


# What counts as naming a source: a link, a source of the table at the top, a man page, a check.
SOURCE = re.compile(
    r"\]\(https?://|nvml\.h|pynvml|systemd \d{3}|systemd\.[a-z-]+\(\d\)|modprobe|kernel modules"
    r"|psutil|sdnotify|gpustat|issue #\d+|\(checked\)|\(unconfirmed\)|NEWS"
)


def test_every_fact_section_names_a_source() -> None:
    """Each numbered paragraph of facts.md says where its fact comes from."""
    paragraphs = re.split(r"\n(?=\*\*\d+\.\d+ )", FACTS)[1:]
    assert len(paragraphs) > 20  # a positive control: the split finds the paragraphs
    unsourced = [p.split("**")[1] for p in paragraphs if not SOURCE.search(p)]
    assert unsourced == []


def test_the_docs_samples_name_no_developers_working_tree() -> None:
    """README and docs show no path of a developer's own checkout or test run in their samples."""
    developer = re.compile(r"/work/(?:wt|main)/|/pytest-of-|/\.venv/lib/")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if developer.search(line)
    ]
    assert found == []
