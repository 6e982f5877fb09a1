"""The float GEMM of each supported layer type and its two backward products.

A kernel (``kernels/``) runs these on its quantized operands; the autograd Function in
``layers.py`` decides which operands each product gets (gradient bifurcation, SPEC 4). Each also
says which outputs depend on a non-finite input element (``non_finite_outputs``), the ones the
float layer leaves NaN or infinite: the 8-bit layers' codes cannot carry such a value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_weight

from ..utils.layout import is_channels_last


def _non_finite_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A linear map's ``non_finite_outputs``: ``(..., 1)`` bool, broadcastable to ``y``, the rows
    (over the last dim) of `x` holding a NaN or an infinity (`w` is not read)."""
    return ~torch.isfinite(x).all(-1, keepdim=True)


class LinearGemm:
    """``nn.Linear``: ``y = x @ W.T + b``; ``x (..., in)``, ``W (out, in)``, ``y (..., out)``."""

    non_finite_outputs = staticmethod(_non_finite_rows)

    def forward(self, x, w, b):
        return F.linear(x, w, b)

    def grad_input(self, g, w, input_shape):
        """``dL/dx = g @ W``, shape `input_shape`."""
        return (g @ w).reshape(input_shape)

    def grad_weight(self, x, g, weight_shape):
        """``dL/dW = g.T @ x`` summed over every leading dim, shape ``(out, in)``."""
        return (g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])).reshape(weight_shape)

    def grad_bias(self, g):
        return g.reshape(-1, g.shape[-1]).sum(0)


class TransposedLinearGemm:
    """transformers' ``Conv1D`` (GPT-2 family): ``y = x @ W + b`` with ``W (in, out)``."""

    non_finite_outputs = staticmethod(_non_finite_rows)

    def forward(self, x, w, b):
        return F.linear(x, w.T, b)

    def grad_input(self, g, w, input_shape):
        return (g @ w.T).reshape(input_shape)

    def grad_weight(self, x, g, weight_shape):
        """``dL/dW = x.T @ g`` summed over every leading dim, shape ``(in, out)``."""
        return (x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])).reshape(weight_shape)

    def grad_bias(self, g):
        return g.reshape(-1, g.shape[-1]).sum(0)


def conv_output_hw(input_hw, kernel_size, stride, padding, dilation) -> tuple[int, int]:
    """``(Ho, Wo)`` of a zero-padded convolution of an ``(H, W)`` input (``nn.Conv2d``'s formula)."""
    return tuple((size + 2 * p - d * (k - 1) - 1) // s + 1
                 for size, k, s, p, d in zip(input_hw, kernel_size, stride, padding, dilation))


@dataclass(frozen=True)
class Conv2dGemm:
    """``nn.Conv2d`` with numeric zero padding: ``x (N, Cin, H, W)`` -> ``y (N, Cout, Ho, Wo)``."""

    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    def forward(self, x, w, b):
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def non_finite_outputs(self, x, w):
        """``(N, Cout, Ho, Wo)`` bool: the outputs whose window, in their group's channels, holds a
        NaN or an infinity of ``x (N, Cin, H, W)``. The count of such taps is the convolution of the
        group's non-finite indicator with a kernel of ones (integers, exact in fp32)."""
        n, c, h, width = x.shape
        cout, _, kh, kw = w.shape
        bad = (~torch.isfinite(x)).reshape(n, self.groups, c // self.groups, h, width).any(2).to(x.dtype)
        taps = torch.ones(self.groups, 1, kh, kw, dtype=x.dtype, device=x.device)
        reached = F.conv2d(bad, taps, None, self.stride, self.padding, self.dilation, self.groups) > 0.5
        return reached.repeat_interleave(cout // self.groups, dim=1)

    def grad_input(self, g, w, input_shape):
        """``dL/dx`` of shape `input_shape` from ``g (N, Cout, Ho, Wo)`` and ``w``: the convolution
        backward with only the input gradient asked for. It reads the input's shape and layout, not
        its values, so it gets an uninitialised tensor in `g`'s layout (row-major, or channels last
        for a channels-last `g`: ``dL/dx`` then comes channels last too, as the int8 kernel's does,
        and adds to the shortcut's gradient without a layout change); ``torch.nn.grad.conv2d_input``'s
        stride-0 placeholder sends the CPU backward down a ~20% slower path (same values)."""
        layout = torch.empty(input_shape, dtype=g.dtype, device=g.device,
                             memory_format=torch.channels_last if is_channels_last(g) else torch.contiguous_format)
        return torch.ops.aten.convolution_backward(
            g, layout, w, None, self.stride, self.padding, self.dilation, False, [0, 0], self.groups,
            (True, False, False),
        )[0]

    def grad_weight(self, x, g, weight_shape):
        return conv2d_weight(x, weight_shape, g, self.stride, self.padding, self.dilation, self.groups)

    def grad_bias(self, g):
        return g.sum((0, 2, 3))


Gemm = LinearGemm | TransposedLinearGemm | Conv2dGemm
