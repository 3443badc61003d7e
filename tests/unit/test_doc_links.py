"""Every relative link in the README and docs/ points at a file or folder that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Link targets outside fenced code that name a path (no scheme, not a bare #anchor)."""
    targets = LINK.findall(FENCE.sub("", text))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_link_finder_sees_relative_links_and_skips_urls_anchors_and_code():
    text = '[a](docs/x.md#part) [b](https://e.org) [c](#top) [d](../y.md "t")\n```\n[e](z.md)\n```\n'
    assert relative_links(text) == ["docs/x.md#part", "../y.md"]


def test_every_relative_link_resolves():
    broken = []
    for doc in _documents():
        for target in relative_links(doc.read_text()):
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_lab_record_is_in_the_lab_index():
    lab = ROOT / "docs" / "lab"
    indexed = set(relative_links((lab / "README.md").read_text()))
    missing = [p.name for p in sorted(lab.glob("20*.md")) if p.name not in indexed]
    assert not missing, f"add a line for each to docs/lab/README.md: {missing}"
