"""The one interface every linear layer of our models goes through, so quantized weights can slot in."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearLayer(Protocol):
    """y = x @ W.T (+ b). Implementations may store W however they like (dense, int8, int4)."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # [tokens, in] -> [tokens, out]


class DenseLinear(nn.Module):
    """A plain dense weight in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None  # [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
