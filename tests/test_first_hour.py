"""A first hour with a real model: the compile notice, the background compile, threads, the chat-ready CLI, names.

The CLI's replies are checked against HF's eager model fed the same chat-formatted ids (the oracle); the compiled
decode step compiled in the background must give greedy's tokens before, during and after the swap.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import transformers
from tiny_models import save_tiny

from hf_dsinfer.cli import main
from hf_dsinfer.generation.api import GEN_ATTR
from hf_dsinfer.log import LOGGER_NAME

pytestmark = pytest.mark.usefixtures("one_thread")

# A chat template of the usual shape: turns marked by role, the assistant's turn opened at the end.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
EAGER = "cpu_compile=false"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> str:
    """A one-layer tiny Llama whose tokenizer has a chat template."""
    path = save_tiny("llama", tmp_path_factory.mktemp("chat"), num_hidden_layers=1)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def oracle(chat_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32).eval()


def _greedy(model, tok, ids: list[int], n: int) -> str:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)  # fmt: skip
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def _run_json(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_applies_the_chat_template(chat_dir, oracle, capsys):
    tok = transformers.AutoTokenizer.from_pretrained(chat_dir)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    ids = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
    report = _run_json(capsys, chat_dir, "--prompt", "Hello world", "--system", "Be brief.", "--max-new-tokens", "5",
                       "--set", EAGER)  # fmt: skip
    assert report["chat"] is True and report["prompt_tokens"] == len(ids)
    assert report["texts"] == [_greedy(oracle, tok, ids, 5)]  # the reply alone, as HF generates it from those ids

    raw = _run_json(capsys, chat_dir, "--prompt", "Hello world", "--no-chat", "--max-new-tokens", "5", "--set", EAGER)
    raw_ids = tok("Hello world")["input_ids"]
    assert raw["chat"] is False and raw["prompt_tokens"] == len(raw_ids)
    assert raw["texts"] == ["Hello world" + _greedy(oracle, tok, raw_ids, 5)]  # raw text: prompt + continuation


def test_generate_streams_the_reply(chat_dir, oracle, capsys):
    tok = transformers.AutoTokenizer.from_pretrained(chat_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False)
    assert main(["generate", chat_dir, "--prompt", "Hi", "--max-new-tokens", "6", "--set", EAGER]) == 0
    out = capsys.readouterr().out
    streamed, rest = out.split("\n-- ", 1)  # the streamed reply, then the figures
    assert streamed == _greedy(oracle, tok, ids, 6)
    assert rest.startswith("warm-up call") and "tokens/s" in rest


def test_system_without_a_template_is_refused(tmp_path):
    path = save_tiny("llama", tmp_path / "plain", num_hidden_layers=1)
    with pytest.raises(SystemExit, match="--system needs a chat template, but this tokenizer has no chat template"):
        main(["generate", path, "--prompt", "Hi", "--system", "Be brief."])


def test_an_immediate_eos_is_explained(chat_dir, oracle, tmp_path, capsys):
    # make the token greedy picks first the end-of-sequence token: the model answers nothing
    tok = transformers.AutoTokenizer.from_pretrained(chat_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False)
    first = int(oracle.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])
    path = save_tiny("llama", tmp_path / "eos", num_hidden_layers=1)  # the same weights (seed 0)
    tok.save_pretrained(path)
    config = transformers.GenerationConfig.from_pretrained(path)
    config.eos_token_id = first
    config.save_pretrained(path)
    report = _run_json(capsys, path, "--prompt", "Hi", "--set", EAGER)
    assert report["new_tokens"] == 1 and report["texts"] == [""]
    assert len(report["notes"]) == 1 and "ended its reply immediately (EOS as the first token)" in report["notes"][0]
    assert "--system" in report["notes"][0]  # chat mode: rephrase / --system / sampling


def test_threads_flag_sets_torch_threads(chat_dir, capsys):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        report = _run_json(capsys, chat_dir, "--prompt", "Hi", "--max-new-tokens", "2", "--threads", "2",
                           "--set", EAGER)  # fmt: skip
        assert torch.get_num_threads() == 2 and report["new_tokens"] == 2
        # the config field alone does the same at load
        torch.set_num_threads(1)
        transformers.AutoModelForCausalLM.from_pretrained(chat_dir, inference_config={"threads": 3})
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        transformers.AutoModelForCausalLM.from_pretrained(chat_dir, inference_config={"threads": 0})


def test_busy_machine_warning(monkeypatch, caplog):
    from hf_dsinfer import log
    from hf_dsinfer.generation import threads

    monkeypatch.setattr(log, "_WARNED", set())
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (9.5, 5.0, 2.0))
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert threads.warn_if_busy(2, how="--threads 1")
        assert not threads.warn_if_busy(1)  # one thread: nothing to advise
    (record,) = [r for r in caplog.records if "machine is busy" in r.getMessage()]
    assert re.search(r"load average 9\.5 on \d+ cores", record.getMessage()) and "--threads 1" in record.getMessage()
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert threads.busy_machine() is None


def test_smollm2_name_resolves(tmp_path, monkeypatch):
    from hf_dsinfer import real_model

    folder = tmp_path / "smollm2"  # an existing path wins over the name
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    assert real_model.resolve_model_name("smollm2") == "smollm2"
    assert real_model.resolve_model_name("org/some-model") == "org/some-model"
    monkeypatch.chdir(tmp_path / "smollm2")
    if not real_model.smollm2_available():
        pytest.skip(f"SmolLM2 is not installed ({real_model.SMOLLM2_INSTALL})")
    path = real_model.resolve_model_name("SmolLM2")
    assert path == real_model.smollm2_path()
    assert transformers.AutoConfig.from_pretrained(path).model_type == "llama"


def test_compile_notice_and_background_swap(chat_dir, oracle, monkeypatch, caplog):
    """The notice appears once when the compile starts (in the background), decoding goes on eagerly meanwhile, the
    compiled step is swapped in once ready, and the greedy tokens are HF's throughout; nothing with cpu_compile off."""
    import threading

    from hf_dsinfer.generation import compile_priority, compiled_cpu

    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "1")
    # the compile thread lowers its own priority (1 here: a test suite on a busy machine must not starve it)
    monkeypatch.setenv(compile_priority.NICE_ENV, "1")
    lowered = []
    real_lower = compiled_cpu.lower_priority

    def spy(nice: int) -> None:
        lowered.append((threading.current_thread().name, nice))
        real_lower(nice)

    monkeypatch.setattr(compiled_cpu, "lower_priority", spy)  # the name compiled_cpu calls
    ids = torch.tensor([[5, 9, 3, 7]])
    want = oracle.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    config = {"dtype": "fp32", "max_out_tokens": 32, "max_batch_size": 1, "cpu_compile": True}  # True: at once
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        eager = transformers.AutoModelForCausalLM.from_pretrained(
            chat_dir, inference_config={**config, "cpu_compile": False}
        )
        assert torch.equal(eager.generate(ids, **kwargs), want)
        assert not [r for r in caplog.records if "compiling the CPU" in r.getMessage()]

        model = transformers.AutoModelForCausalLM.from_pretrained(chat_dir, inference_config=config)
        compiled = getattr(model, GEN_ATTR).step.compiled
        assert torch.equal(model.generate(ids, **kwargs), want)  # eager steps while compiling (or swapped in)
        notices = [r for r in caplog.records if "compiling the CPU decode step for batch 1" in r.getMessage()]
        assert len(notices) == 1 and notices[0].levelno == logging.WARNING
        assert "in the background" in notices[0].getMessage() and "'cpu_compile': False" in notices[0].getMessage()
        assert compiled.wait(timeout=600) and not compiled.failed and set(compiled.compile_s) == {1}
        assert lowered == [("hf_dsinfer-compile-1", 1)]  # in the compile thread only
        replays = compiled.runner.stats.replays
        assert torch.equal(model.generate(ids, **kwargs), want)  # compiled now
        assert compiled.runner.stats.replays == replays + 11  # every decode step ran compiled
        # At 2 threads the bucket's team variant compiles in the background too (one-thread steps meanwhile), then
        # the governor runs both; the tokens stay HF's.
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(model.generate(ids, **kwargs), want)
            assert compiled.wait(timeout=600) and list(compiled.team_compile_s) == [(1, 2)]
            assert lowered[-1] == ("hf_dsinfer-compile-1x2", 1)
            assert torch.equal(model.generate(ids, **kwargs), want)
            assert set(compiled.governors[1]._avg) == {1, 2}
        finally:
            torch.set_num_threads(before)
    assert len([r for r in caplog.records if "compiling the CPU" in r.getMessage()]) == 1  # no second notice


def test_auto_compiles_only_after_eager_steps_cost_a_compile(chat_dir, oracle, monkeypatch, caplog):
    """cpu_compile="auto" (the default): a short run decodes eagerly and starts no compile; the eager time is counted
    per bucket towards AUTO_AFTER_S."""
    from hf_dsinfer.generation import compiled_cpu

    monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "1")
    monkeypatch.setattr(compiled_cpu, "AUTO_AFTER_S", 3600.0)
    model = transformers.AutoModelForCausalLM.from_pretrained(chat_dir, inference_config={"max_batch_size": 1})
    compiled = getattr(model, GEN_ATTR).step.compiled
    assert compiled.auto
    ids = torch.tensor([[5, 9, 3, 7]])
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert torch.equal(model.generate(ids, **kwargs), oracle.generate(ids, **kwargs))
    assert not [r for r in caplog.records if "compiling the CPU" in r.getMessage()]
    assert not compiled.pending and not compiled.compile_s and 0 < compiled._eager_s[1] < 3600


def test_passive_waiting_on_a_busy_machine():
    """A busy machine at the start of generate / serve / bench: OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP
    (a fresh interpreter: the CLI imports no torch before it decides); never over the user's own setting."""
    import os
    import subprocess
    import sys

    code = """
import os
os.getloadavg = lambda: (99.0, 99.0, 99.0)
from hf_dsinfer.cli import passive_wait_when_busy
assert not passive_wait_when_busy("info")
assert passive_wait_when_busy("generate") and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
assert not passive_wait_when_busy("serve") and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
del os.environ["OMP_WAIT_POLICY"]
import torch
assert not passive_wait_when_busy("bench")  # too late: OpenMP read its settings when torch loaded
"""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_exit_waits_for_a_background_compile(caplog):
    """A compile still running at exit is waited for (interpreter shutdown would end its thread mid-trace)."""
    import threading
    import time as _time

    from hf_dsinfer.generation import compiled_cpu

    thread = threading.Thread(target=_time.sleep, args=(0.5,), daemon=True)
    compiled_cpu._BACKGROUND.add(thread)
    thread.start()
    try:
        with caplog.at_level("WARNING", logger="transformers.hf_dsinfer"):
            compiled_cpu._join_background_compiles()
        assert not thread.is_alive()
        assert any("waiting for 1 background compile" in r.getMessage() for r in caplog.records)
    finally:
        compiled_cpu._BACKGROUND.discard(thread)


def test_eager_steps_leave_a_core_to_a_background_compile():
    """While a background compile runs, the eager steps use one thread fewer (never zero), restored after."""
    from hf_dsinfer.generation import compile_priority

    before = torch.get_num_threads()
    try:
        for threads, inside in ((2, 1), (3, 2), (1, 1)):
            torch.set_num_threads(threads)
            with compile_priority.leave_a_core():
                assert torch.get_num_threads() == inside
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(__import__("os"), "setpriority"), reason="per-thread priorities (Linux)")
def test_background_compile_lowers_only_its_own_priority(monkeypatch):
    """The compile thread runs at nice 19 by default (HF_DSINFER_COMPILE_NICE overrides; 0 keeps the caller's), the
    calling thread keeps its priority, and a bad value is refused naming the variable."""
    import os
    import threading

    from hf_dsinfer.generation import compile_priority

    def nice_of_this_thread() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    caller = nice_of_this_thread()
    for env, want in ((None, 19), ("7", max(7, caller)), ("0", caller)):
        if env is None:
            monkeypatch.delenv(compile_priority.NICE_ENV, raising=False)
        else:
            monkeypatch.setenv(compile_priority.NICE_ENV, env)
        seen: list[int] = []

        def compile_thread(nice: int = compile_priority.compile_nice(), seen: list[int] = seen) -> None:
            compile_priority.lower_priority(nice)
            seen.append(nice_of_this_thread())

        thread = threading.Thread(target=compile_thread)
        thread.start()
        thread.join(30)
        assert seen == [want]
        assert nice_of_this_thread() == caller
    for bad in ("low", "-5", "20"):
        monkeypatch.setenv(compile_priority.NICE_ENV, bad)
        with pytest.raises(ValueError, match=compile_priority.NICE_ENV):
            compile_priority.compile_nice()
