"""DeepSpeed's ``moe`` inference section (``DeepSpeedMoEConfig``), with its names and aliases.

``moe`` may be ``True`` (enabled, defaults), ``False``/``None``/``{}`` (no section), a dict, or a :class:`MoEConfig`.
Keys: ``enabled`` (True), ``ep_size`` (1: under tensor parallelism every expert is split by features over the ranks;
N, a divisor of ``tensor_parallel.tp_size`` and of the experts: N expert groups of ``tp_size / N`` ranks, each group
holding ``1/N`` of the experts split by features over its ranks; checked when the split is planned), ``moe_experts``
(alias ``num_experts``; DeepSpeed's per-layer expert counts, checked against the model's when given), ``type``
(alias ``moe_type``; only ``"standard"``: DeepSpeed's PR-MoE ``"residual"`` layers do not exist in transformers
models), ``ep_group`` (alias ``expert_group``: a process group for expert parallelism; default: the tensor-parallel
group or the world), ``ep_mp_group`` (alias ``expert_mp_group``: refused unless None, see the message).
DeepSpeed's deprecated top-level ``ep_size``, ``moe_experts``, ``moe_type``, ``ep_group`` (alias ``expert_group``),
``ep_mp_group`` (alias ``expert_mp_group``) map here.
Process groups stay in memory and are never written to JSON.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

MOE_FIELDS: dict[str, Any] = {
    "enabled": True,
    "ep_size": 1,
    "moe_experts": [1],
    "type": "standard",
    "ep_group": None,
    "ep_mp_group": None,
}
MOE_ALIASES = {
    "num_experts": "moe_experts",
    "moe_type": "type",
    "expert_group": "ep_group",
    "expert_mp_group": "ep_mp_group",
}
#: DeepSpeed's deprecated top-level keys -> their key in the ``moe`` section.
MOE_TOP_LEVEL = {
    "ep_size": "ep_size",
    "moe_experts": "moe_experts",
    "moe_type": "type",
    "ep_group": "ep_group",
    "ep_mp_group": "ep_mp_group",
    "expert_group": "ep_group",  # DeepSpeed's aliases of the two above
    "expert_mp_group": "ep_mp_group",
}
_RUNTIME = ("ep_group", "ep_mp_group")  # process-group objects: kept in memory, never serialized
MOE_TYPES = ("standard",)


class MoEConfig:
    """DeepSpeed's ``moe`` section. Build it with :meth:`from_value`, which also accepts ``True`` and dicts."""

    def __init__(self, **kwargs: Any):
        values: dict[str, Any] = {}
        for key, value in kwargs.items():
            canon = MOE_ALIASES.get(key, key)
            if canon not in MOE_FIELDS:
                valid = list(MOE_FIELDS) + list(MOE_ALIASES)
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"Unknown moe key {key!r}.{hint} Valid keys: {', '.join(sorted(valid))}.")
            if canon in values and values[canon] != value:
                raise ValueError(f"moe.{canon} is given twice (as {key!r} too) with different values; pass it once.")
            values[canon] = value
        merged = {**MOE_FIELDS, **values}
        self.enabled = merged["enabled"]
        self.ep_size = merged["ep_size"]
        self.moe_experts = list(merged["moe_experts"]) if isinstance(merged["moe_experts"], (list, tuple)) else None
        self.type = merged["type"]
        self.ep_group = merged["ep_group"]
        self.ep_mp_group = merged["ep_mp_group"]
        self._check(merged)

    def _check(self, merged: dict[str, Any]) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"moe.enabled must be True or False, got {self.enabled!r}.")
        if isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise ValueError(
                f"moe.ep_size must be an integer >= 1 (ranks the experts are split over), got {self.ep_size!r}."
            )
        if self.moe_experts is None or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.moe_experts
        ):
            raise ValueError(
                f"moe.moe_experts must be a list of expert counts >= 1 (e.g. [8]), got {merged['moe_experts']!r}."
            )
        if self.type not in MOE_TYPES:
            raise ValueError(
                f"moe.type={self.type!r} is not supported: DeepSpeed's PR-MoE 'residual' experts have no transformers "
                "model; use 'standard' (the mixture of experts that mixtral / qwen2_moe / qwen3_moe models compute)."
            )
        if self.ep_mp_group is not None:
            raise ValueError(
                "moe.ep_mp_group (expert_mp_group) is not supported: hf_dsinfer slices experts over the tensor-"
                "parallel group; pass that group as tensor_parallel.tp_group and leave ep_mp_group unset."
            )

    @classmethod
    def from_value(cls, value: Any) -> MoEConfig | None:
        """``True`` -> enabled defaults; ``False``/``None``/``{}`` -> None (no section); a dict or a MoEConfig."""
        if value is None or value is False or (isinstance(value, Mapping) and not value):
            return None
        if value is True:
            return cls()
        if isinstance(value, MoEConfig):
            return value
        if isinstance(value, Mapping):
            return cls(**value)
        raise ValueError(f"moe must be True/False or a dict such as {{'enabled': True, 'ep_size': 2}}, got {value!r}.")

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the experts are split over (1 when the section is disabled)."""
        return self.ep_size if self.enabled else 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable values (process groups left out)."""
        return {
            "enabled": self.enabled,
            "ep_size": self.ep_size,
            "moe_experts": list(self.moe_experts),
            "type": self.type,
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MoEConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict() and self.ep_group is other.ep_group

    def __deepcopy__(self, memo: dict) -> MoEConfig:
        # Process groups cannot be deep-copied: share them.
        return MoEConfig(**self.to_dict(), ep_group=self.ep_group)

    def __repr__(self) -> str:
        return f"MoEConfig({self.to_dict()})"


def merge_top_level_moe_keys(values: dict[str, Any], top_level: dict[str, Any]) -> None:
    """Fold DeepSpeed's deprecated top-level MoE keys (``ep_size``, ``moe_experts``, ...) into ``values["moe"]``.

    A key given both ways with different values raises. The section becomes enabled only if it was not disabled.
    """
    if not top_level:
        return
    current = values.get("moe")
    if isinstance(current, MoEConfig):
        section: dict[str, Any] = {**current.to_dict(), "ep_group": current.ep_group}
    elif current is True or current is None or current == {}:
        section = {}
    elif current is False:
        section = {"enabled": False}
    elif isinstance(current, Mapping):
        section = {MOE_ALIASES.get(k, k): v for k, v in current.items()}
    else:
        section = {}  # an invalid value: MoEConfig.from_value names it later
    for key, value in top_level.items():
        sub = MOE_TOP_LEVEL[key]
        if sub in section and section[sub] != value:
            raise ValueError(f"moe.{sub}={section[sub]!r} conflicts with the top-level {key}={value!r}; pass one.")
        section[sub] = value
    values["moe"] = section
