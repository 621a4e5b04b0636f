"""Config keys the readers deliberately do not read, each with the reason it changes no memory
memcalc models. A key that is neither read nor listed here is reported
(:func:`memcalc.inputs.hf_config.unread_keys`): a note on stderr, an error with ``strict``.
"""

from __future__ import annotations

_ROPE = "rotary frequencies (theta, scaling type and factors) are values: no tensor changes size"
_ROUTER = "a routing value (scaling, normalisation, grouping): no tensor changes size"
_AUX = "the router auxiliary loss: a scalar per layer (memcalc models the LM loss)"

#: every model_type
COMMON: dict[str, str] = {
    "model_type": "selects the reader",
    "architectures": "the class name; the reader follows model_type's modeling file",
    "_name_or_path": "a label (used as the report name)",
    "name_or_path": "a label",
    "auto_map": "remote-code class names (the reader follows transformers' own modeling file)",
    "bos_token_id": "a token id", "eos_token_id": "a token id", "pad_token_id": "a token id",
    "sep_token_id": "a token id", "decoder_start_token_id": "a token id",
    "torch_dtype": "the stored checkpoint dtype; the training precision is memcalc's --precision",
    "dtype": "the stored checkpoint dtype; the training precision is memcalc's --precision",
    "transformers_version": "a label",
    "use_cache": "the inference KV cache; a training step runs without it",
    "initializer_range": "initialisation values",
    "rope_theta": _ROPE, "rope_scaling": _ROPE, "rope_parameters": _ROPE, "rope_type": _ROPE,
    "original_max_position_embeddings": _ROPE,
    "tokenizer_class": "the tokenizer", "chat_template": "the tokenizer",
    "output_attentions": "an inference output switch", "output_hidden_states": "an inference output switch",
    "return_dict": "an output container switch",
    "pretraining_tp": "a tensor-parallel reshuffle of the original training; the parameters are the same",
    "quantization_config": "the stored checkpoint format; memcalc's precision (--bf16, --qlora) sets how weights "
                           "are held for training (quantized checkpoints are dequantized to train)",
    "max_window_layers": "used only with use_sliding_window (refused when true)",
    "cache_implementation": "the inference KV cache",
    "use_bidirectional_attention": "a mask choice (causal for causal LM training): no parameters",
    "attention_softmax_in_fp32": "a numerics switch of the original code",
    "layer_norm_epsilon": "a value", "classifier_dropout": "a classification head memcalc does not build",
    "router_aux_loss_coef": _AUX, "output_router_logits": _AUX, "router_jitter_noise": "a training-noise value",
    "norm_topk_prob": _ROUTER, "routed_scaling_factor": _ROUTER, "n_group": _ROUTER, "topk_group": _ROUTER,
    "topk_method": _ROUTER, "scoring_func": _ROUTER, "aux_loss_alpha": _AUX, "seq_aux": _AUX,
    "ep_size": "expert-parallel size of the original code (one GPU holds all experts here)",
    "_attn_implementation": "the attention kernel the checkpoint was saved with; memcalc's kernel profile "
                            "(--attention) sets the kernel of the estimate",
    "transformers.js_config": "a transformers.js export setting",
}

#: model_type -> {key: reason}
BY_TYPE: dict[str, dict[str, str]] = {
    "llama": {"is_llama_config": "a SmolLM2 export marker", "rope_interleaved": _ROPE},
    "qwen2": {"use_mrope": "multimodal rotary sections (Qwen2-VL); false in the text models: no parameters"},
    "gpt2": {"n_special": "legacy OpenAI-GPT key (no special-token rows in GPT2LMHeadModel)",
             "predict_special_tokens": "legacy OpenAI-GPT key"} | {k: "GPT2DoubleHeads summary head / attention numerics, not in GPT2LMHeadModel" for k in (
        "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
        "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "task_specific_params",
        "n_ctx")},
    "starcoder2": {"activation_function": "a duplicate of hidden_act in early configs (Starcoder2 reads hidden_act)",
                   "mlp_type": "always default in released configs", "norm_type": "layer_norm (Starcoder2 uses it)",
                   "scale_attention_softmax_in_fp32": "a numerics switch", "scale_attn_weights": "a numerics switch",
                   "layer_norm_epsilon": "a duplicate of norm_epsilon"},
    "gpt_neox": {"rotary_emb_base": _ROPE, "use_flash_attn": "a kernel switch", "bos_token_id": "a token id"},
    "phi3": {"interpolate_factor": _ROPE, "full_attn_mod": "Phi-4-mini remote-code switch (1 = every layer full)"},
    "gpt_oss": {"experts_per_token": "a duplicate of num_experts_per_tok", "swiglu_limit": "an activation clamp value",
                "swiglu_alpha": "an activation value", "initial_context_length": _ROPE},
    "deepseek_v2": {"moe_layer_freq": "DeepseekV2DecoderLayer ignores it: MoE from first_k_dense_replace on",
                    "num_key_value_heads": "MLA: keys and values come per head from the latent",
                    "head_dim": "MLA: the head widths are qk_nope/qk_rope/v_head_dim",
                    "qk_head_dim": "qk_nope_head_dim + qk_rope_head_dim"},
    "deepseek_v3": {"moe_layer_freq": "DeepseekV3DecoderLayer ignores it: MoE from first_k_dense_replace on",
                    "num_nextn_predict_layers": "the multi-token-prediction layer transformers does not build",
                    "num_key_value_heads": "MLA: keys and values come per head from the latent",
                    "head_dim": "MLA: the head widths are qk_nope/qk_rope/v_head_dim",
                    "qk_head_dim": "qk_nope_head_dim + qk_rope_head_dim",
                    "rope_interleave": _ROPE, "mlp_bias": "DeepseekV3MLP has no biases"},
    "smollm3": {"no_rope_layers": "layers that skip the rotation: no parameters", "no_rope_layer_interval": "the NoPE layer cadence: no parameters"},
    "stablelm": {"head_dim": "StableLmAttention uses hidden_size // num_attention_heads"},
    "falcon": {"rotary": "legacy: rotary unless alibi", "head_dim": "FalconAttention uses hidden_size // heads",
               "n_head": "legacy alias", "n_layer": "legacy alias"},
    "cohere": {"rotary_pct": "unused by CohereAttention"},
    "phi": {"qk_layernorm": "read (refused when true)"},
}


def ignored(model_type: str) -> dict[str, str]:
    """Keys deliberately not read for ``model_type``, with their reasons."""
    return {**COMMON, **BY_TYPE.get(model_type, {})}
