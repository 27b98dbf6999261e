"""The version a reader is told to install is the package's: one place, the Debian changelog.

``packaging/debian/changelog``'s newest entry is the package version; its upstream part is
``gpuguard.__version__`` (the Debian build checks that too). Every place a document names the
current package - a ``gpuguard_VERSION_amd64.deb`` file, an apt ``Pin: version`` - must say
the same, so a release cannot leave a page telling operators to install the one before.
Versions named as history ("before 0.1.0-3") are not instructions and are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import gpuguard

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "packaging" / "debian" / "changelog"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The forms that name the version to install; VERSION and {{ … }} placeholders do not match.
CURRENT = re.compile(r"gpuguard_(\d[\w.+~-]*)_amd64\.deb|^Pin: version (\d\S*)", re.MULTILINE)


def package_version() -> str:
    """The newest changelog entry's version, e.g. ``0.1.0-3``."""
    first = CHANGELOG.read_text().splitlines()[0]
    match = re.fullmatch(r"gpuguard \(([^)]+)\) \S+; urgency=\w+", first)
    assert match, first
    return match.group(1)


def named_versions(text: str) -> list[str]:
    """The package versions ``text`` tells a reader to install."""
    return [deb or pin for deb, pin in CURRENT.findall(text)]


def test_the_changelog_carries_the_python_version() -> None:
    """The package's upstream version is the code's ``__version__``."""
    assert package_version().rsplit("-", 1)[0] == gpuguard.__version__


def test_documents_name_the_current_package_version() -> None:
    """Each .deb file name and apt pin in README.md and docs/ is the changelog's version."""
    current = package_version()
    named = {
        f"{path.relative_to(ROOT)}: {version}"
        for path in DOCUMENTS
        for version in named_versions(path.read_text())
    }
    assert named, "no version found: the pattern is wrong"
    assert sorted(n for n in named if not n.endswith(f": {current}")) == []


def test_the_check_sees_both_forms_and_skips_placeholders() -> None:
    """A .deb name and a pin are found; VERSION and templates are not versions."""
    text = (
        "apt install ./gpuguard_0.1.0-2_amd64.deb\nPin: version 0.1.0-9\n"
        "reprepro includedeb stable gpuguard_VERSION_amd64.deb\n"
        "      Pin: version {{ gpuguard_version }}\n"
    )
    assert named_versions(text) == ["0.1.0-2", "0.1.0-9"]
