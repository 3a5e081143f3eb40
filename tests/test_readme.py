"""The README's quick start runs as written (in a temporary folder: it saves a model under ./tiny-llama)."""

import pathlib
import re


def test_readme_quick_start_runs(capsys, tmp_path, monkeypatch):
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    # the engine's logits over the prompt and the 8 generated tokens: [1, 4 + 8, vocab]
    assert re.search(r"torch\.Size\(\[1, 12, \d+\]\)", out), out
    assert (tmp_path / "tiny-llama" / "config.json").exists()
