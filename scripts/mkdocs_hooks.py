"""MkDocs hook: the site's home page is the README, so the two cannot differ. The README links
to the pages as ``docs/NAME.md`` (right on a repository's web view); on the site they sit beside
it, so the prefix goes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_as_home(markdown: str) -> str:
    """The README with its ``docs/`` links made relative to the docs folder."""
    return re.sub(r"\]\(docs/", "](", markdown)


def on_page_read_source(page: Any, config: Any) -> str | None:
    if page.file.src_uri == "index.md":
        return readme_as_home(README.read_text(encoding="utf-8"))
    return None
