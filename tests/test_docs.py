"""The documentation builds (MkDocs, strict: a broken link or anchor between pages, or a page left
out of the navigation, fails), and its generated pages are current."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loongsage.config_reference import render_reference

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_build_strictly_with_every_page_linked(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert {"index", "architecture", "config", "recipes"} <= pages
    assert all((tmp_path / "site" / ("" if p == "index" else p) / "index.html").is_file() for p in pages)


def test_a_broken_link_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](missing.md)\n")
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text().split("nav:")[0] + "nav:\n  - Home: index.md\n")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode != 0 and "missing.md" in out.stdout + out.stderr


def test_the_config_reference_is_generated_from_the_current_schema():
    assert (ROOT / "docs" / "config.md").read_text() == render_reference(), \
        "docs/config.md is stale: python scripts/render_config_reference.py"


def test_every_error_the_troubleshooting_page_quotes_is_still_raised_by_the_code():
    import re

    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    quoted = re.findall(r"\*\*`([^`]+)`\*\*", page)
    assert len(quoted) >= 15
    source = "\n".join(p.read_text() for p in (ROOT / "loongsage").rglob("*.py"))
    # a quote may span an f-string's placeholders ("..."): each literal piece must be in the source
    missing = [q for q in quoted if not all(part.strip() in source for part in q.split("...") if part.strip())]
    assert not missing, f"docs/troubleshooting.md quotes errors the code no longer raises: {missing}"
