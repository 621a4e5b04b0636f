"""The field contract: every field of the specs changes the estimate, or is listed here.

``tests/unit/test_field_contract.py`` iterates every ``model_fields`` of :class:`ModelSpec`,
:class:`LoraSpec`, :class:`TrainingSpec`, :class:`KernelProfile` and
:class:`ExperimentSpec`, perturbs each field on a setup where it can matter, and asserts
that an estimated number changes, unless the field is in :data:`INERT` (with the reason)
or :data:`NESTED` (a spec whose own fields are checked). A new field without a decision
fails that test.

Fields that matter only in some setups are in :data:`CONDITIONAL`: where they change
nothing, the estimate says so in ``Estimate.notes``
(``memcalc.estimate.peak.no_effect_notes``), which the text report and ``--json`` show.
"""

from __future__ import annotations

#: "Spec.field" -> why the field never changes an estimated number.
INERT: dict[str, str] = {
    "ModelSpec.name": "a label shown in reports",
    "ModelSpec.norm_eps": "a value, not a shape: no tensor changes size",
    "ModelSpec.residual_scale": "a value: with post-norm, a scale other than 1 adds one transient x * alpha "
                                "(engine.ops.scale) that is freed before the layer's larger allocations, so it "
                                "sets no peak",
    "ModelSpec.embedding_scale": "a value: the scaled copy of the embeddings (engine.blocks.embedding) lives beside "
                                 "the unscaled one only until the multiply returns, at the start of the forward "
                                 "(a multiply by a Python scalar saves nothing), so it sets no peak",
    "LoraSpec.alpha": "a value (the adapter scale alpha / rank), not a shape: the scaling op runs either way",
    "KernelProfile.name": "a label shown in reports",
    "KernelProfile.torch_version": "a label: what a version changes is set by the profile's other fields "
                                   "(rmsnorm from memcalc.core.kernels.RMSNORM_BY_TORCH, mean_saves_input, sdpa_gqa; "
                                   "memcalc.inputs.profiles.profile_for)",
    "KernelProfile.device": "only cuda is modelled (the field's one allowed value)",
    "KernelProfile.framework": "a label: what a framework changes is set by the profile's rule fields "
                               "(memcalc.inputs.profiles.FRAMEWORKS: rmsnorm, logits_fp32, shift_copy, cross_entropy, "
                               "lora_dtype, lora_input_cast, sdpa_gqa, gelu_new, kv_cache)",
    "MoESpec.routing": "one value (balanced), the stated assumption: transformers' default grouped_mm experts size "
                       "every routed tensor by batch x seq x top_k alone, so the routing moves no byte "
                       "(memcalc.engine.blocks.moe); LitGPT's per-expert loop sizes each expert's tensors by its "
                       "share (memcalc.core.rules.balanced_rows, the shapes its validator answers)",
    "ExperimentSpec.name": "a label shown in reports",
    "ExperimentSpec.description": "a label shown in reports",
    "ExperimentSpec.published_peak_bytes": "comparison data (a measured peak), not an input to the estimate",
    "ExperimentSpec.published_source": "comparison data (where the measured peak comes from)",
    "DeepSpeedSpec.stage": "mirrors TrainingSpec.zero (the spec requires them equal: a config's stage sets both); "
                           "zero is the field perturbed",
    "DeepSpeedSpec.allgather_bucket_size": "ZeRO-2 all-gathers the updated partitions into its flat 16-bit buffer in "
                                           "place (stage_1_and_2.py step: all_gather_dp_groups), no buffer of this "
                                           "size is made; ZeRO-3 gathers by its prefetch bucket instead",
}

#: "Spec.field" -> the spec class whose fields are checked one by one instead.
NESTED: dict[str, str] = {
    "ExperimentSpec.model": "ModelSpec",
    "ExperimentSpec.training": "TrainingSpec",
    "ExperimentSpec.profile": "KernelProfile",
    "ModelSpec.moe": "MoESpec",
    "ModelSpec.mla": "MLASpec",
    "TrainingSpec.deepspeed": "DeepSpeedSpec",
}

#: "Spec.field" -> what is not modelled yet. These fields change no parameter shape (or change
#: the estimate only through their parameters) and their activation rules are still to come
#: (issue 12: the helpers modelling activations replace each entry with a PERTURB row).
PENDING: dict[str, str] = {
}

#: "Spec.field" -> the setups where the option changes nothing; the estimate's notes say so there.
CONDITIONAL: dict[str, str] = {
    "TrainingSpec.zero": "one GPU (nothing to shard) but DeepSpeed ZeRO-2/3 (its partitions and buckets run on one "
                         "rank too); stage 1 with offload_optimizer (the state is on the CPU)",
    "TrainingSpec.gpus": "zero 0 (plain data parallelism: a whole copy per GPU; only NCCL's buffers join the "
                         "device total, memcalc.core.gpu_side)",
    "TrainingSpec.sharding": "one GPU or zero 0 (nothing is sharded, so no framework's sharding runs), but "
                             "DeepSpeed ZeRO-2/3 on one GPU (DeepSpeed's partitions and buckets of world size 1)",
    "TrainingSpec.checkpoint_every": "any checkpoint mode but every-k",
    "TrainingSpec.memory_budget": "compile with checkpointing (the regions are recomputed whole)",
    "TrainingSpec.optimizer_impl": "optimizers whose step makes no temporaries (sgd, sgd-momentum)",
    "TrainingSpec.galore_rank": "every optimizer but galore-adamw (the rank of GaLore's projection)",
    "TrainingSpec.offload_optimizer": "optimizers without state (sgd) and no master weights",
    "LoraSpec.quant_block": "LoRA without qlora (the base is not quantised)",
    "LoraSpec.double_quant": "LoRA without qlora (the base is not quantised)",
    "LoraSpec.bnb_saves_input": "LoRA without qlora (the base is not quantised)",
    "KernelProfile.loss_chunks": "cross_entropy full (the loss is not chunked)",
    "KernelProfile.loss_tokens": "cross_entropy full or chunked (the loss runs on every position, ignored or not)",
    "KernelProfile.liger_ops": "kernels none (no Liger kernel is applied)",
    "LoraSpec.dtype": "precision fp32 or amp-* (the base weights are fp32, so are the adapters either way)",
    "DeepSpeedSpec.offload_param": "ZeRO-2 or no DeepSpeed (DeepSpeed reads it at stage 3 only)",
    "TrainingSpec.sequence_parallel": "tp 1 (no tensor-parallel group to shard the sequence over)",
    "TrainingSpec.ep_capacity_factor": "ep 1 (no all-to-all dispatch whose received rows it scales)",
    "TrainingSpec.pp_schedule": "pp 1 (no pipeline: nothing is scheduled over stages)",
    "TrainingSpec.microbatches": "pp 1 (no pipeline: the batch is not split into micro-batches)",
    "TrainingSpec.pp_stages_per_rank": "pp 1 (no pipeline: there are no stages to hold)",
    "TrainingSpec.pp_first_stage_less_layers": "pp 1 (no pipeline: the layers are not split)",
    "TrainingSpec.pp_last_stage_less_layers": "pp 1 (no pipeline: the layers are not split)",
}
