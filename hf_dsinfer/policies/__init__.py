"""hf_dsinfer.policies: per-architecture kernel-injection policies, their registry, and ``inject``.

``POLICIES`` maps ``config.model_type`` to the policy serving it (``hf-dsinfer info`` lists them). Importing this
package registers every family below; a new family is one module here plus one import line (docs/policies.md).
"""

# Importing a family module registers its policy.
from . import (  # noqa: F401
    bert,
    bloom,
    cohere,
    encoders,
    falcon,
    gemma,
    gemma2,
    gemma3,
    glm4,
    gpt2,
    gpt_neo,
    gpt_neox,
    gptj,
    granite,
    llama,
    olmo2,
    opt,
    starcoder2,
)
from .base import POLICIES, POLICIES_BY_CLASS, Cat, Param, Policy, Source, Transposed, find_policy, register
from .injection import get_injection, hf_state_dict, inject, is_injected, validate_injection_policy
from .moe import MixtralPolicy, Qwen2MoePolicy, Qwen3MoePolicy  # noqa: F401  (register the MoE families)
from .tp_layout import TPLayout

__all__ = [
    "POLICIES",
    "POLICIES_BY_CLASS",
    "Cat",
    "Param",
    "Policy",
    "Source",
    "TPLayout",
    "Transposed",
    "find_policy",
    "get_injection",
    "hf_state_dict",
    "inject",
    "is_injected",
    "register",
    "validate_injection_policy",
]
