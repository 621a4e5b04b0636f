"""The estimate's notes on the mixture-of-experts and multi-head latent attention blocks
(:mod:`.moe`, :mod:`.mla`): what their activations assume in a given setup."""

from __future__ import annotations

from memcalc.core.spec import ExperimentSpec
from memcalc.core.units import fmt_bytes
from memcalc.engine.params import param_inventory


def family_notes(exp: ExperimentSpec) -> list[str]:
    """The activation assumptions of the MoE and MLA blocks in this setup, for the estimate's notes."""
    m, tr = exp.model, exp.training
    notes = []
    if m.moe is not None:
        moe = m.moe
        if tr.ep > 1:  # engine/expert_parallel.py: the rows a rank receives are the stated capacity factor's
            notes.append(
                f"expert parallelism: this rank receives {tr.ep_capacity_factor:g} x its "
                f"{'micro-batch' if tr.pp > 1 else 'batch'} x seq x "
                f"{moe.top_k} routed rows for its {moe.n_experts // tr.ep} experts (--ep-capacity-factor; 1 = "
                "the even split); the busiest rank of an imbalanced routing receives more, and every buffer the "
                "dispatcher and the experts make grows with it")
        elif moe.implementation == "litgpt":
            notes.append(
                f"MoE routing assumed {moe.routing} (each expert gets batch x seq x {moe.top_k}/{moe.n_experts} "
                "rows): LitGPT's LLaMAMoE runs its experts one by one (litgpt/model.py LLaMAMoE.forward, "
                "torch.where per expert), so the saved rows add up to the same total, but an imbalanced step "
                "makes the busiest expert's temporaries larger than counted here")
        else:
            notes.append(
                f"MoE routing assumed {moe.routing} (each expert gets batch x seq x {moe.top_k}/{moe.n_experts} "
                "rows); transformers' default grouped_mm experts size every tensor by the routed rows alone, so an "
                "imbalanced step costs the same activation bytes here (not so with the eager per-expert loop)")
        adapted = [p for p in param_inventory(m, tr.lora) if ".moe.experts." in p.name and p.kind == "lora"]
        if adapted and moe.implementation == "litgpt":  # blocks/litgpt_moe.py
            notes.append("LoRA on the routed experts: LitGPT's lora_mlp makes the router and every expert's fc_1, "
                         "fc_2 and proj a LoRALinear of rank r (litgpt/lora.py LLaMAMoE), whose branch runs beside "
                         "the frozen weight (no merged W + B A)")
        elif adapted:
            n_layers = sum(moe.is_moe_layer(i) for i in range(m.n_layers))
            per_layer = tr.weight_dtype.nbytes(
                sum(p.numel for p in param_inventory(m) if p.layer == next(i for i in range(m.n_layers)
                                                                          if moe.is_moe_layer(i))
                    and p.kind == "experts"))
            notes.append(
                f"LoRA on the routed experts: PEFT materialises W + B A for each adapted expert tensor, and the "
                f"grouped matmul keeps it for backward: {fmt_bytes(per_layer)} per MoE layer x {n_layers} layers "
                "of saved activations")
        if moe.expert_bias:
            notes.append("gpt-oss experts: the clamped SwiGLU is counted as act(gate) * up (its extra pointwise "
                         "tensors are not modelled)")
    if m.mla is not None and tr.checkpoint == "selective":
        notes.append("checkpoint selective: multi-head latent attention runs its attention core eagerly "
                     "(not recomputed)")
    return notes
