"""Without Triton (macOS / Windows have no wheels) hf_dsinfer still imports and runs its torch paths.

A subprocess hides ``triton`` from the import system, then loads a tiny llama with kernel injection, compares it with
HF and checks that forcing the Triton backend fails with a message that says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, os, sys

    class HideTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("No module named " + repr(name))
            return None

    sys.meta_path.insert(0, HideTriton())
    sys.path.insert(0, {here!r})
    import torch, transformers
    import hf_dsinfer
    from hf_dsinfer.kernels import backend, rms_norm
    from hf_dsinfer.policies import is_injected
    from tiny_models import build_tiny

    assert "triton" not in sys.modules and not backend.triton_available()
    ref = build_tiny("llama")
    model = hf_dsinfer.init_inference(build_tiny("llama"), dtype="fp32", replace_with_kernel_inject=True).module
    assert is_injected(model)
    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    os.environ["HF_DSINFER_BACKEND"] = "triton"
    try:
        rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)
    except RuntimeError as e:
        assert "triton is not installed" in str(e), e
    else:
        raise AssertionError("forcing the triton backend without triton must raise")
    print("OK")
    """
)


def test_imports_and_runs_torch_paths_without_triton(tmp_path):
    script = tmp_path / "no_triton.py"
    script.write_text(SCRIPT.format(here=HERE))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DSINFER_BACKEND", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
