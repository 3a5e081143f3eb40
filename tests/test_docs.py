"""Docs stay true: every command block in README.md and docs/*.md is either run here or excluded with a reason.

Before a fenced ``python``/``bash``/``sh``/``console`` block (or one without a language), put one HTML comment line:

* ``<!-- runnable -->``: run as written (python in this process, bash with ``bash -e`` in a temporary directory that
  links ``examples/`` and ``scripts/``, the venv's executables first on ``PATH``);
* ``<!-- runnable: slow -->``: the same, marked ``slow``;
* ``<!-- runnable: setup=NAME -->``: a python block run after ``tests/doc_setups.py``'s ``NAME(tmp_path)`` has
  defined the names it takes from the user's program (``path``, ``model``, ...); may be combined with ``slow``;
* ``<!-- not run: REASON -->``: not run here, and why (GPU only, several machines, a fragment of the user's own
  program, ...), naming the test that covers the same code where one does.

Keep runnable blocks fast (tiny models, CPU, short arguments): all of them together take well under a minute.
README's links to docs must resolve.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import doc_setups
import pytest

ROOT = pathlib.Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# An optional marker comment on the line(s) right before a fence, the fence's language, the block's body.
BLOCK = re.compile(r"(?:<!--(?P<marker>[^\n]*?)-->[ \t]*\n[ \t]*\n?)?^```(?P<lang>[\w-]*)[ \t]*\n(?P<code>.*?)^```",
                   flags=re.S | re.M)  # fmt: skip
COMMAND_LANGS = {"", "python", "py", "bash", "sh", "shell", "console"}


def _blocks() -> list[tuple[str, int, str, str, str]]:
    """``(doc, line, lang, marker, code)`` of every command block."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            if m.group("lang") in COMMAND_LANGS:
                line = text.count("\n", 0, m.start("lang")) + 1
                out.append((path.name, line, m.group("lang"), (m.group("marker") or "").strip(), m.group("code")))
    return out


def _parse(marker: str) -> dict | None:
    """``{"slow": bool, "setup": str | None}`` for a runnable marker; None otherwise."""
    if marker != "runnable" and not marker.startswith("runnable:"):
        return None
    opts = {"slow": False, "setup": None}
    for word in marker.removeprefix("runnable").lstrip(":").split():
        if word == "slow":
            opts["slow"] = True
        elif word.startswith("setup="):
            opts["setup"] = word.removeprefix("setup=")
        else:
            raise ValueError(f"unknown runnable option {word!r} in <!-- {marker} -->")
    return opts


def _runnable_params() -> list:
    params = []
    for doc, line, lang, marker, code in _blocks():
        opts = _parse(marker)
        if opts is not None:
            marks = [pytest.mark.slow] if opts["slow"] else []
            params.append(pytest.param(doc, line, lang, opts["setup"], code, id=f"{doc}:{line}", marks=marks))
    return params


def test_every_command_block_is_run_or_excluded_with_a_reason():
    unmarked = [f"{doc}:{line}" for doc, line, _, marker, _ in _blocks() if not marker]
    assert not unmarked, (
        f"command blocks without <!-- runnable --> or <!-- not run: REASON --> before them: {unmarked} "
        "(see tests/test_docs.py)"
    )
    bad = []
    for doc, line, _, marker, _ in _blocks():
        if marker.startswith("not run:"):
            if len(marker.removeprefix("not run:").strip()) < 10:
                bad.append(f"{doc}:{line} (give the reason)")
        elif _parse(marker) is None:
            bad.append(f"{doc}:{line} (unknown marker {marker!r})")
    assert not bad, f"badly marked command blocks: {bad}"


@pytest.mark.parametrize("doc, line, lang, setup, code", _runnable_params())
def test_runnable_doc_block(doc, line, lang, setup, code, tmp_path, monkeypatch):
    if lang in ("python", "py"):
        scope = getattr(doc_setups, setup)(tmp_path) if setup else {}
        monkeypatch.chdir(tmp_path)  # files a block writes land in the temporary directory
        exec(compile(code, f"{doc}:{line}", "exec"), scope)
        return
    assert setup is None, f"{doc}:{line}: setup= applies to python blocks only"
    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"{doc}:{line} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [link for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", text) if not (ROOT / link).is_file()]
    assert not missing, f"README links to missing files: {missing}"
