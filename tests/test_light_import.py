"""``import hf_dsinfer`` stays light: the Hybrid Engine's dependencies (peft, transformers' Trainer) load on first use.

Checked in a fresh interpreter (this test process has imported everything already). Module absence, not timing, is
asserted: import times depend on the machine and its load.
"""

import subprocess
import sys
import textwrap

HEAVY = ("peft", "transformers.trainer", "transformers.trainer_callback", "trl")


def test_import_does_not_load_peft_or_the_trainer():
    script = textwrap.dedent(
        f"""
        import sys
        import hf_dsinfer
        from transformers import AutoModelForCausalLM  # the from_pretrained hook is in place
        assert hasattr(AutoModelForCausalLM.from_pretrained, "__wrapped__")
        loaded = [m for m in {HEAVY!r} if m in sys.modules]
        assert not loaded, f"import hf_dsinfer loaded {{loaded}}"
        engine = hf_dsinfer.HybridEngine  # first use imports the hybrid package
        assert engine.__name__ == "HybridEngine" and "hf_dsinfer.hybrid.engine" in sys.modules
        assert "HybridEngineCallback" in dir(hf_dsinfer)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
