"""Rotary position embedding as a cos/sin table: every rope scaling variant is just another table."""

from __future__ import annotations

import torch
from torch import nn

from hf_dsinfer.kernels import apply_rotary_
from hf_dsinfer.kernels.backend import use_triton

from .kv_cache import _device_free_bytes

# fp32 [P, R/2] tensors alive at once while a table is built: freqs, cos, sin and a rounded copy of one of them.
_TABLES_AT_PEAK = 4


def _check_table_memory(max_positions: int, half_dim: int, device: torch.device) -> None:
    """Raise ``MemoryError`` naming ``max_out_tokens`` when the cos/sin tables cannot fit the device.

    The table has one row per position the static cache can hold, so an absurd ``max_out_tokens`` would otherwise
    fail inside torch's allocator with no hint of which setting asked for the memory.
    """
    need = _TABLES_AT_PEAK * max_positions * half_dim * 4
    free = _device_free_bytes(device)
    if free is not None and need > free:
        raise MemoryError(
            f"The rotary table for max_out_tokens={max_positions} needs {need / 2**30:.2f} GiB on {device}, but only "
            f"{free / 2**30:.2f} GiB are available; lower max_out_tokens in the inference config (it counts prompt "
            "plus generated tokens)."
        )


class RotaryTable(nn.Module):
    """``cos``/``sin`` tables ``[max_positions, R/2]`` (fp32) and the in-place rotation of q and k.

    Build it with :meth:`from_inv_freq` from the frequencies a model's own rotary module computed, so scaled
    variants (linear, NTK, yarn, llama3, ...) come out exactly as the model defines them. ``R = 2 * len(inv_freq)``
    is the rotary dim; head dims past ``R`` are left alone (partial rotary).
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False):
        super().__init__()
        if cos.shape != sin.shape or cos.ndim != 2:
            raise ValueError(f"cos/sin must be matching [P, R/2] tables, got {tuple(cos.shape)} / {tuple(sin.shape)}")
        # Not persistent: the table is derived from the config, never saved with the weights.
        self.register_buffer("cos", cos.float().contiguous(), persistent=False)  # [P, R/2]
        self.register_buffer("sin", sin.float().contiguous(), persistent=False)  # [P, R/2]
        self.interleaved = interleaved

    @classmethod
    def from_inv_freq(
        cls,
        inv_freq: torch.Tensor,
        max_positions: int,
        attention_scaling: float = 1.0,
        round_to: torch.dtype | None = None,
        interleaved: bool = False,
    ) -> RotaryTable:
        """Table for positions ``[0, max_positions)``: ``cos(p * inv_freq) * attention_scaling`` (same for sin).

        ``round_to``: round the entries to this dtype (kept in fp32 storage). HF casts its cos/sin to the activation
        dtype before rotating, so rounding the table the same way keeps half-precision results closer to HF's.
        """
        inv_freq = inv_freq.detach().float()  # [R/2]
        _check_table_memory(max_positions, inv_freq.shape[0], inv_freq.device)
        pos = torch.arange(max_positions, device=inv_freq.device, dtype=torch.float32)  # [P]
        freqs = pos[:, None] * inv_freq[None, :]  # [P, R/2]
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
        if round_to is not None and round_to != torch.float32:
            cos, sin = cos.to(round_to).float(), sin.to(round_to).float()
        return cls(cos, sin, interleaved=interleaved)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.cos.shape[1]

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [N, Hq, D]`` and ``k [N, Hk, D]`` in place by ``positions [N]``; returns ``(q, k)``."""
        return apply_rotary_(q, k, self.cos, self.sin, positions, interleaved=self.interleaved)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width angle rows of ``positions [N]`` for :meth:`rotate_rows_`: ``(cos, sin)``, each ``[N, 1, R]`` fp32.

        A forward step gathers them once and every layer reuses them (the torch path's per-layer cost is then a
        handful of elementwise ops, which matters on CPU where each op costs microseconds).
        """
        c, s = self.cos[positions], self.sin[positions]  # [N, R/2]
        if self.interleaved:
            c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
        else:
            c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        return c[:, None], s[:, None]  # [N, 1, R]

    def rotate_rows_(self, x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``x [N, H, D]`` in place with rows from :meth:`rows`; the same fp32 math as the kernels' reference.

        ``x`` may be q and k side by side (a view of a fused QKV output): heads are independent.
        """
        cos, sin = rows
        R = self.rotary_dim
        part = x[..., :R]  # [N, H, R] view
        xf = part.float()  # a view when x is fp32: rot below is a new tensor before anything is written
        # rot = (-b, a): the swapped copy first, then its first element of each pair / half negated in place
        if self.interleaved:
            rot = torch.stack((xf[..., 1::2], xf[..., 0::2]), dim=-1).flatten(-2)  # (a, b) -> (b, a) per pair
            rot[..., 0::2].neg_()
        else:
            half = R // 2
            rot = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)  # (a, b) -> (b, a) over halves
            rot[..., :half].neg_()
        rot.mul_(sin)
        if xf is part:
            # fp32: a' = a c - b s, b' = b c + a s in place, with the same roundings as the expression below; the
            # three [N, H, R] temporaries it would allocate cost page faults on long prompts (8 x 512 tokens: 12 MB
            # each per layer)
            part.mul_(cos).add_(rot)
        else:
            part.copy_(xf * cos + rot)
        return x

    def uses_rows(self, x: torch.Tensor) -> bool:
        """True when rotating ``x`` takes the torch path, where per-step :meth:`rows` pay off."""
        return not use_triton(x)
