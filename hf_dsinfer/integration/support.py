"""Which architectures hf_dsinfer knows and which path each takes (shown by ``hf-dsinfer info``)."""

from __future__ import annotations

# Architectures proven by the fidelity table (tests/test_fidelity.py), by model_type.
TESTED_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gpt2", "gpt_neox", "opt", "falcon", "bert",
    # issue 17's families
    "gemma", "olmo2", "granite", "starcoder2", "gptj", "gemma3_text", "cohere", "glm4", "gpt_neo", "roberta",
    "distilbert", "bloom",
    # issue 16's mixture-of-experts families
    "mixtral", "qwen2_moe", "qwen3_moe",
)


def registered_policies() -> dict[str, object]:
    """model_type -> kernel-injection policy, as registered by ``hf_dsinfer.policies`` (empty when none are)."""
    from .. import policies

    return dict(getattr(policies, "POLICIES", {}))


def architecture_paths() -> dict[str, str]:
    """model_type -> the path a model of that type takes with ``replace_with_kernel_inject=True``."""
    policies = registered_policies()
    out = {}
    for model_type in sorted(set(TESTED_ARCHITECTURES) | set(policies)):
        if model_type in policies:
            out[model_type] = f"fused layers ({type(policies[model_type]).__name__})"
        else:
            out[model_type] = "HF modules, config dtype applied"
    return out
