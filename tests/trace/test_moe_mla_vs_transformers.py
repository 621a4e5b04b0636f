"""The replica's MoE block and MLA attention against transformers 5.23's own modules, byte for byte.

Each side is traced on ``meta`` (forward, then backward from a gradient of the output's shape) with
the storage tracer: the bytes alive after forward and the peak over forward and backward must be
equal. transformers runs its default ``grouped_mm`` experts; its SDPA call is routed to the
memory-efficient kernel CUDA picks for MLA's unequal head dims (on meta ``F.scaled_dot_product_attention``
would take the math path); its handwritten RMSNorm (``weight * x.to(fp32)...to(dtype)``) saves what
the ``composite-legacy`` profile does.
"""

from __future__ import annotations

import pytest

# needs torch and transformers: left out of the quick lane
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memcalc.core.spec import KernelProfile, MLASpec, ModelSpec, MoESpec, TrainingSpec  # noqa: E402
from memcalc.validate.amp import Amp  # noqa: E402
from memcalc.validate.blocks.sdpa import rope_tables, sdpa  # noqa: E402
from memcalc.validate.blocks.mla import MLAttention  # noqa: E402
from memcalc.validate.model import BuildConfig  # noqa: E402
from memcalc.validate.blocks.moe import MoEBlock  # noqa: E402
from memcalc.validate.tracer import StorageTracer  # noqa: E402

D, E, K, F_E, B, T = 256, 16, 4, 256, 2, 512
BF16 = torch.bfloat16


def _trace(module, call, extra=()) -> tuple[int, int]:
    """(bytes alive after forward, peak over forward + backward), both above the module's weights."""
    x = torch.empty(B, T, D, dtype=BF16, device="meta", requires_grad=True)
    tr = StorageTracer("meta")
    with tr:
        tr.track(list(module.parameters()) + list(module.buffers()) + [x, *extra])
        base = tr.current
        y = call(module, x)
        y = y[0] if isinstance(y, tuple) else y
        live = tr.current - base
        y.backward(torch.empty_like(y))
        return live, tr.record.bytes - base


def _hf_block(family: str):
    m = transformers.models
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F_E,
                                          norm_topk_prob=True)
        return cfg, m.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock, MoESpec(n_experts=E, top_k=K, d_ff_expert=F_E)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=D, num_local_experts=E, num_experts_per_tok=K, intermediate_size=F_E)
        return cfg, m.mixtral.modeling_mixtral.MixtralSparseMoeBlock, MoESpec(n_experts=E, top_k=K, d_ff_expert=F_E,
                                                                            router="softmax-fp32")
    if family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F_E,
                                          shared_expert_intermediate_size=512, norm_topk_prob=True)
        return cfg, m.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock, MoESpec(
            n_experts=E, top_k=K, d_ff_expert=F_E, n_shared_experts=1, d_ff_shared=512, shared_expert_gate=True)
    cfg = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F_E,
                                        n_shared_experts=1, n_group=8, topk_group=4)
    return cfg, m.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE, MoESpec(n_experts=E, top_k=K, d_ff_expert=F_E,
                                                                         n_shared_experts=1, router="sigmoid")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_block_is_the_transformers_block(family):
    cfg, cls, spec = _hf_block(family)
    cfg._experts_implementation = "grouped_mm"  # what PreTrainedModel picks for these classes by default
    with torch.device("meta"):
        hf = cls(cfg).to(BF16)
    m = ModelSpec(name=family, n_layers=1, d_model=D, n_heads=4, d_ff=512, vocab_size=64, moe=spec)
    cfg_r = BuildConfig(m, TrainingSpec(precision="bf16"), KernelProfile(), "meta", Amp(None), False)
    ours = MoEBlock(m, cfg_r, 0)
    assert _trace(ours, lambda mod, x: mod(x)) == _trace(hf, lambda mod, x: mod(x))


def _efficient(module, q, k, v, mask, dropout=0.0, scaling=None, **kw):
    """transformers' sdpa_attention_forward with the kernel CUDA runs for MLA (memory-efficient)."""
    out = sdpa(q, k, v, None, "efficient", dropout, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("q_lora_rank", [128, None])
def test_mla_is_deepseek_v3_attention(q_lora_rank):
    from transformers import AttentionInterface
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    AttentionInterface.register("memcalc_efficient", _efficient)
    H = 16
    dims = dict(kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
    cfg = transformers.DeepseekV3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=H,
                                        q_lora_rank=q_lora_rank, **dims)
    cfg._attn_implementation = "memcalc_efficient"
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, device="meta").float() / 32))
    cos, sin = rope_tables(inv, T, BF16)
    with torch.device("meta"):
        hf = DeepseekV3Attention(cfg, 0).to(BF16)
    m = ModelSpec(name="mla", n_layers=1, d_model=D, n_heads=H, d_ff=512, vocab_size=64,
                  mla=MLASpec(q_lora_rank=q_lora_rank, **dims))
    cfg_r = BuildConfig(m, TrainingSpec(precision="bf16"), KernelProfile(rmsnorm="composite-legacy"), "meta",
                        Amp(None), False)
    ours = MLAttention(m, cfg_r)
    pe = (cos.expand(B, -1, -1), sin.expand(B, -1, -1))
    assert _trace(ours, lambda mod, x: mod(x, cos, sin), (cos, sin)) == \
        _trace(hf, lambda mod, x: mod(x, pe, None), (cos, sin))
