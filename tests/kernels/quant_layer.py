"""The module the compiled-path tests of kernels/quant_cpu.py hand to ``torch.compile``: a CPU pack and a bias held as
attributes, as a quantized linear holds them, so dynamo traces ``cpu_quant_matmul`` the way a model's step does."""

from __future__ import annotations

import torch
from hf_dsinfer.kernels.quant_cpu import cpu_quant_matmul


class QuantMatmulLayer(torch.nn.Module):
    def __init__(self, packed, bias):
        super().__init__()
        self.packed, self.bias = packed, bias

    def forward(self, x):
        return cpu_quant_matmul(x, self.packed, self.bias)
