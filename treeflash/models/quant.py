"""Weight-only int8 for the target's linear layers (torch's own CPU kernel, `_weight_int8pack_mm`).

Per-output-channel symmetric scales; activations stay in the model's dtype. This changes the target
(greedy output agrees with the unquantized model on most but not all tokens; `treeflash bench`
reports the agreement), so speculative decoding is lossless with respect to the *quantized*
target. Measured here (1 thread): a 1-row matmul against the 49k x 576 LM head takes 2.1 ms in
int8 vs 5.9 ms in bf16; at 16 rows 15.4 vs 18.4 ms (see docs/performance.md).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import TreeflashError

QUANTIZATIONS = ("none", "int8")


class Int8Linear(nn.Module):
    """y = x @ dequant(w).T + b with w int8 [O, I] and scales [O]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp(min=1e-12)  # [O]
        dtype = linear.weight.dtype
        self.register_buffer("qweight", (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, mode: str) -> int:
    """Replace the decoder's nn.Linear layers and the LM head in place; returns how many."""
    if mode not in QUANTIZATIONS:
        raise TreeflashError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if mode == "none":
        return 0
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.bfloat16, torch.float32) or next(model.parameters()).device.type != "cpu":
        raise TreeflashError("int8 weight-only quantization runs on CPU targets in bfloat16 or float32")
    n = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Int8Linear(child))
                n += 1
    return n
