"""The README's quick start runs as written."""

import pathlib
import re


def test_readme_quick_start_runs(capsys):
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "torch.Size([1, 12, 500])" in out
