"""hf_dsinfer.policies: per-architecture kernel-injection policies, their registry, and ``inject``.

``POLICIES`` maps ``config.model_type`` to the policy serving it (``hf-dsinfer info`` lists them). Importing this
package registers every family below; a new family is one module here plus one import line (docs/policies.md).
"""

from . import bert, falcon, gemma, gemma2, gpt2, gpt_neox, granite, llama, olmo2, opt  # noqa: F401  (register the families)
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
