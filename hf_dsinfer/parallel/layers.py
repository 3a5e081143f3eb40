"""The communicating pieces of a tensor-parallel model.

* :class:`RowParallelLinear` replaces an output projection (``o_proj``, ``down_proj``, ``c_proj`` ...): it adopts
  the (input-sharded) weight and the bias under the same names, so state-dict keys do not change, and adds the bias
  once after the all-reduce.
* Column-parallel linears need no wrapper: their weight just has fewer output rows.
* The word embedding and the LM head stay HF's own modules (subclasses such as scaled embeddings keep working); hooks
  make them vocab-parallel: the embedding looks up only the ids this rank holds and sums over ranks, the head's
  logits are gathered along the vocab dim (the only place a gather is needed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .groups import TPGroup, all_gather_last, all_reduce_

TP_ATTR = "_dsinfer_tp"  # set on every module touched by tensor parallelism (what was done, for repr and re-entry)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: a linear whose input features are split over the group.

    ``weight`` is ``[out, in_local]`` (``nn.Linear`` layout) or ``[in_local, out]`` when ``transposed`` (transformers'
    ``Conv1D``, as in GPT-2). ``bias`` (``[out]``, replicated) is added after the reduce so it counts once.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPGroup, transposed: bool = False):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.transposed = transposed
        self.tp = tp
        self.in_features = weight.shape[0] if transposed else weight.shape[1]  # local
        self.out_features = weight.shape[1] if transposed else weight.shape[0]

    @classmethod
    def wrap(cls, module: nn.Module, tp: TPGroup) -> RowParallelLinear:
        """The wrapper for an (already sharded) ``nn.Linear``-like or ``Conv1D`` module, sharing its parameters."""
        transposed = type(module).__name__ == "Conv1D"
        return cls(module.weight, getattr(module, "bias", None), tp, transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_local] -> partial sums [..., out] -> full sums on every rank
        y = torch.matmul(x, self.weight) if self.transposed else F.linear(x, self.weight)
        all_reduce_(y, self.tp)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (of {self.in_features * self.tp.size}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.tp.size}"
        )


def make_vocab_parallel_embedding(module: nn.Embedding, start: int, stop: int, tp: TPGroup) -> None:
    """Turn ``module`` (holding rows ``[start, stop)`` of the vocab) into a vocab-parallel embedding, in place.

    Ids outside the range look up row 0 and are zeroed; the all-reduce then fills every position from the rank
    that owns its id. Works for ``nn.Embedding`` subclasses (scaled embeddings scale zeros to zeros).
    """
    module.num_embeddings = stop - start
    pad = getattr(module, "padding_idx", None)
    module.padding_idx = pad - start if pad is not None and start <= pad < stop else None
    state: dict[str, torch.Tensor] = {}

    def pre_hook(mod: nn.Module, args: tuple) -> tuple:
        ids = args[0]
        local = ids - start
        outside = (local < 0) | (local >= stop - start)
        state["outside"] = outside
        return (local.masked_fill(outside, 0), *args[1:])

    def post_hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(state.pop("outside").unsqueeze(-1), 0)
        return all_reduce_(out, tp)

    handles = [module.register_forward_pre_hook(pre_hook), module.register_forward_hook(post_hook)]
    setattr(module, TP_ATTR, {"kind": "vocab_embedding", "range": (start, stop), "handles": handles})


def make_vocab_parallel_head(module: nn.Module, sizes: list[int], tp: TPGroup) -> None:
    """Gather the logits of a column (vocab) parallel LM head along the last dim, in rank order, in place."""

    def post_hook(mod: nn.Module, args: tuple, out: Any) -> Any:
        return all_gather_last(out, tp, sizes)

    if hasattr(module, "out_features"):
        module.out_features = sizes[tp.rank]
    handles = [module.register_forward_hook(post_hook)]
    setattr(module, TP_ATTR, {"kind": "vocab_head", "sizes": sizes, "handles": handles})


class FullWidthRMSNorm(nn.Module):
    """An RMSNorm over a width split across the ranks (OLMo-2's q/k norm over all heads, split by heads).

    ``weight`` is this rank's slice ``[width_local]``. The squares are summed locally, then over the ranks (one
    all-reduce of ``[..., 1]``), and divided by the full width, so each rank scales its slice exactly as the unsplit
    norm would. ``share`` is ``1 / copies`` where a slice is replicated on several ranks (kv heads when there are
    fewer of them than ranks), so replicated elements count once. Arithmetic in fp32, weight applied before the cast
    back, as OLMo-2's RMSNorm does.
    """

    def __init__(self, weight: nn.Parameter, eps: float, full_width: int, tp: TPGroup, share: float = 1.0):
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.full_width = full_width
        self.share = share
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., width_local] -> [..., width_local]
        dtype = x.dtype
        x = x.float()
        squares = x.pow(2).sum(-1, keepdim=True)  # [..., 1]
        if self.share != 1.0:
            squares = squares * self.share
        all_reduce_(squares, self.tp)
        x = x * torch.rsqrt(squares / self.full_width + self.eps)
        return (self.weight * x).to(dtype)

    def extra_repr(self) -> str:
        return f"width={self.weight.shape[0]} (of {self.full_width}), eps={self.eps}, tp={self.tp.size}"


def slice_alibi_per_rank(module: nn.Module, start: int, stop: int, heads: int) -> None:
    """Give ``module`` (an attention taking ``alibi=[batch * heads, 1, keys]``) the rows of heads ``[start, stop)``."""

    def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        alibi = kwargs.get("alibi")
        if alibi is not None:
            rest = alibi.shape[1:]
            kwargs["alibi"] = alibi.reshape(-1, heads, *rest)[:, start:stop].reshape(-1, *rest)
        return args, kwargs

    handle = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    # "of": the model's head count, so fused layers can take the slopes of global heads [start, stop)
    setattr(module, TP_ATTR, {"kind": "alibi", "heads": (start, stop), "of": heads, "handles": [handle]})
