"""The training driver's Muon: torch's updates in BF16, FP32 where BF16 is not native."""

import pytest
import torch

from geofp8.tools.train import TrainConfig, optim
from geofp8.tools.train.optim import Muon, build_optimizers, optimizer_info, zeropower


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g))
            for shape in ((24, 40), (40, 24), (16, 16))]


def _run(opt_cls, steps=3, **kwargs):
    params = _params()
    opt = opt_cls(params, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def test_bf16_muon_is_torch_muon_bit_for_bit():
    ours, opt = _run(Muon, ns_dtype=torch.bfloat16)
    ref, ref_opt = _run(torch.optim.Muon)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    # the same state: a torch.optim.Muon checkpoint resumes in ours
    opt.load_state_dict(ref_opt.state_dict())
    assert torch.equal(opt.state[ours[0]]["momentum_buffer"],
                       ref_opt.state[ref[0]]["momentum_buffer"])


def test_fp32_orthogonalization_is_close_to_bf16_and_orthogonalizes():
    g = torch.randn(64, 160, generator=torch.Generator().manual_seed(2))
    coeffs = (3.4445, -4.7750, 2.0315)
    x32 = zeropower(g, coeffs, 5, 1e-7, torch.float32)
    x16 = zeropower(g, coeffs, 5, 1e-7, torch.bfloat16).float()
    assert x32.dtype == torch.float32 and x32.shape == g.shape
    s = torch.linalg.svdvals(x32)
    assert 0.5 < s.min() and s.max() < 1.3  # the quintic's band around 1, not 1 itself
    assert (x32 - x16).norm() / x32.norm() < 0.05  # BF16 rounding, not another algorithm
    fp32, _ = _run(Muon, ns_dtype=torch.float32)
    bf16, _ = _run(Muon, ns_dtype=torch.bfloat16)
    assert not torch.equal(fp32[0], bf16[0])
    assert all((a - b).norm() / b.norm() < 0.01 for a, b in zip(fp32, bf16))


def test_dtype_choice_env_override_and_emulated_avx2(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(optim.NS_DTYPE_ENV, "float32")
    assert optim.orthogonalization_dtype(cpu)[0] == torch.float32
    monkeypatch.setenv(optim.NS_DTYPE_ENV, "bfloat16")
    assert optim.orthogonalization_dtype(cpu) == (torch.bfloat16,
                                                  "GEOFP8_MUON_NS_DTYPE=bfloat16")
    monkeypatch.setenv(optim.NS_DTYPE_ENV, "fp16")
    with pytest.raises(ValueError, match="GEOFP8_MUON_NS_DTYPE"):
        optim.orthogonalization_dtype(cpu)
    monkeypatch.delenv(optim.NS_DTYPE_ENV)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # what an AVX2-only CPU amounts to
    dtype, why = optim.orthogonalization_dtype(cpu)
    assert dtype == torch.float32 and "AVX2" in why
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(optim.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(optim, "_cpu_flags", lambda: {"avx2", "fma"})
    assert optim.native_bf16(cpu) == (False, "x86 CPU without avx512_bf16 or amx_bf16") or \
        not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert optim.orthogonalization_dtype(cpu)[0] == torch.float32
    monkeypatch.setattr(optim, "_cpu_flags", lambda: {"avx2", "avx512_bf16", "amx_bf16"})
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert optim.orthogonalization_dtype(cpu)[0] == (torch.bfloat16 if native
                                                     else torch.float32)


def test_paper_recipe_stays_the_default(monkeypatch):
    from geofp8.tools.models import build_preset

    monkeypatch.setenv(optim.NS_DTYPE_ENV, "float32")
    model = build_preset("llama-tiny", vocab_size=64)
    opts = build_optimizers(model, TrainConfig())
    assert [type(o) for o in opts] == [Muon, torch.optim.AdamW]
    muon_params = {id(p) for p in opts[0].param_groups[0]["params"]}
    assert id(model.model.layers[0].mlp.down_proj.weight) in muon_params
    assert id(model.lm_head.weight) not in muon_params
    assert optimizer_info(opts) == {"optimizers": ["Muon", "AdamW"],
                                    "muon_ns_dtype": "float32",
                                    "muon_ns_reason": "GEOFP8_MUON_NS_DTYPE=float32"}
    assert optimizer_info(build_optimizers(model, TrainConfig(optimizer="adamw"))) == {
        "optimizers": ["AdamW"]}
