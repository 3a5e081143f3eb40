"""Docs stay true: python blocks marked runnable in docs/*.md run as written, and README's links resolve.

Mark a block with an HTML comment line ``<!-- runnable -->`` right before its opening fence. Keep such blocks fast
(tiny models, CPU).
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
RUNNABLE = re.compile(r"<!-- runnable -->\s*\n```python\n(.*?)```", flags=re.S)


def _runnable_blocks() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for i, block in enumerate(RUNNABLE.findall(path.read_text(encoding="utf-8"))):
            out.append((path.name, i, block))
    return out


@pytest.mark.parametrize("doc, index, code", _runnable_blocks() or [pytest.param("", 0, "", marks=pytest.mark.skip)])
def test_runnable_doc_block(doc, index, code):
    exec(compile(code, f"docs/{doc} block {index}", "exec"), {})


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [link for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", text) if not (ROOT / link).is_file()]
    assert not missing, f"README links to missing files: {missing}"
