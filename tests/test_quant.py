"""Weight-only int8 / int4 targets: close to the original, and speculative decoding stays exact for them."""
import pytest
import torch
from torch import nn

from treeflash.decoding.stats import Stats
from treeflash.errors import TreeflashError
from treeflash.models.quant import Int4Linear, Int8Linear

from conftest import oracle, run, tiny_drafter, tiny_target, vanilla

PROMPT = list(range(3, 40, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_to_the_original(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).to(dtype)
    q = Int8Linear(lin)
    x = torch.randn(2, 5, 64, dtype=dtype)
    ref = lin(x).float()
    out = q(x).float()
    assert out.shape == ref.shape and q.qweight.dtype == torch.int8
    assert (out - ref).abs().max() < 0.02 * ref.abs().max() + 0.05
    assert not torch.equal(out, ref)  # it is a different model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_close_to_the_original(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).to(dtype)
    q = Int4Linear(lin)
    x = torch.randn(2, 5, 64, dtype=dtype)
    ref = lin(x).float()
    out = q(x)
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.float() - ref).norm() / ref.norm()
    assert 1e-4 < err < 0.1  # 4-bit groups of 32: a few percent, and not the original
    # dequantising by hand gives the kernel's result
    w = lin.weight.detach().float().view(96, 2, 32)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    deq = (((w - lo) / s).round().clamp(0, 15) * s + lo).view(96, 64)
    want = x.float() @ deq.T + lin.bias.float()
    assert (out.float() - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("mode,backend", [("int8", "hf"), ("int8", "static"), ("int4", "static")])
def test_quantized_target_is_decoded_exactly(mode, backend):
    layer = {"int8": Int8Linear, "int4": Int4Linear}[mode]
    target = tiny_target("qwen2", logit_scale=3.0).quantize(mode).set_backend(backend)
    assert isinstance(target.lm_head, layer) and isinstance(target.drafting_head, nn.Linear)
    assert isinstance(target.model.model.layers[0].self_attn.q_proj, layer)
    drafter = tiny_drafter(target)
    ref = vanilla(target, PROMPT, 40)
    stats = Stats()
    out = run(target, oracle("treeflash", target, drafter, PROMPT + ref, 16), PROMPT, 40, stats=stats)
    assert out == ref and stats.mean_acceptance_length > 1.5


def test_quantizing_twice_or_unknown_modes_are_errors():
    target = tiny_target("llama")
    with pytest.raises(TreeflashError, match="unknown quantization"):
        target.quantize("int3")
    target.quantize("int8").quantize("int8")  # idempotent
    with pytest.raises(TreeflashError, match="already quantized"):
        target.quantize("none")
