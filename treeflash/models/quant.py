"""Weight-only int8 / int4 for the target's linear layers (torch's own CPU kernels).

int8: per-output-channel symmetric scales, `_weight_int8pack_mm`. int4: asymmetric groups of 32
input channels (scale and zero point per group), `_weight_int4pack_mm_for_cpu` (the "tinygemm"
layout); activations stay in the model's dtype (int4 computes in bfloat16). This changes the target
(greedy output agrees with the unquantized model on most but not all tokens; `treeflash bench`
reports the agreement), so speculative decoding is lossless with respect to the *quantized*
target. int8 makes a one-row forward much cheaper than bf16 while a 16-row one costs about the same,
so trees become relatively dearer (docs/performance.md, "Quantized targets (`--quantize int8|int4`)";
`treeflash profile --quantize int8 --verify-costs static` measures it).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import TreeflashError

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32


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


class Int4Linear(nn.Module):
    """y = x @ dequant(w).T + b, w in 4 bits: w = (q - 8) * scale + zero per group of 32 inputs."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP):
        super().__init__()
        O, I = linear.weight.shape
        w = linear.weight.detach().float().view(O, I // group, group)  # [O, G, group]
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)                         # [O, G, 1]
        q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).view(O, I)
        zero = lo + 8 * scale
        sz = torch.stack([scale.view(O, -1), zero.view(O, -1)], -1).transpose(0, 1).contiguous()  # [G, O, 2]
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))
        self.register_buffer("scales_zeros", sz.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.group, self.in_features, self.out_features = group, I, O

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


LAYERS = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_linears(model: nn.Module, mode: str) -> int:
    """Replace the decoder's nn.Linear layers and the LM head in place; returns how many."""
    if mode not in QUANTIZATIONS:
        raise TreeflashError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if mode == "none":
        return 0
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.bfloat16, torch.float32) or next(model.parameters()).device.type != "cpu":
        raise TreeflashError(f"{mode} weight-only quantization runs on CPU targets in bfloat16 or float32")
    linears = [(module, name, child) for module in list(model.modules())
               for name, child in list(module.named_children()) if type(child) is nn.Linear]
    bad = [name for _, name, child in linears if mode == "int4" and child.in_features % INT4_GROUP]
    if bad:  # checked before anything changes
        raise TreeflashError(f"int4 needs input sizes divisible by {INT4_GROUP}; {bad[0]} is not")
    for module, name, child in linears:
        setattr(module, name, LAYERS[mode](child))
    return len(linears)
