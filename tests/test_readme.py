"""The README's quick start runs as written (in a temporary folder: it saves a model under ./tiny-llama), and so do
the command lines it shows next on that folder."""

import pathlib
import re
import shlex

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_quick_start_runs(capsys, tmp_path, monkeypatch):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    # the engine's logits over the prompt and the 8 generated tokens: [1, 4 + 8, vocab]
    assert re.search(r"torch\.Size\(\[1, 12, \d+\]\)", out), out
    assert (tmp_path / "tiny-llama" / "config.json").exists()

    # the shell block after the quick start: the hf-dsinfer commands on the folder it saved, run as written
    from hf_dsinfer.cli import main

    after = text[text.index(blocks[0]) :]
    shell = re.search(r"```bash\n(.*?)```", after, flags=re.S).group(1)
    commands = [shlex.split(line, comments=True) for line in shell.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["hf-dsinfer", "generate"], ["hf-dsinfer", "info"]]
    for command in commands:
        assert main(command[1:]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Hello world")  # no chat template: the prompt, then its continuation
    assert "-- warm-up call" in out and "new tokens: 16" in out and "transformers" in out and "llama" in out
