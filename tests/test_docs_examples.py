"""Every Python block in docs/ marked ``<!-- run -->`` runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
MARKER = "<!-- run -->"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def marked_blocks() -> list[tuple[str, str]]:
    """(id, source) of each ```python block whose fence follows a run marker line."""
    blocks = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            if before.strip() == MARKER:
                line = text.count("\n", 0, match.start()) + 1
                blocks.append((f"{page.name}:{line}", match.group(1)))
    return blocks


BLOCKS = marked_blocks()


def test_the_docs_have_runnable_examples() -> None:
    assert BLOCKS, f"no ```python block follows a {MARKER} line in docs/"


@pytest.mark.parametrize("source", [s for _, s in BLOCKS], ids=[i for i, _ in BLOCKS])
def test_marked_example_runs(source: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(source, "docs example", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out.strip()
