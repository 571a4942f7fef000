"""MkDocs hook (mkdocs.yml `hooks`): the site's home page is the repository's README.md, so the
front door has one copy. docs/index.md is a placeholder whose text this replaces; the README's
links into docs/ become the site's own (`docs/data.md` -> `data.md`)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    return re.sub(r"\]\(docs/", "](", README.read_text())
