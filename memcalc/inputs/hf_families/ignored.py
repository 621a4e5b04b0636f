"""Config keys no family reads, each with the reason it changes no memory memcalc models
(:data:`COMMON`); a family's own ignored keys are its adapter's ``ignored``. A key that is neither
read nor ignored is reported (:func:`memcalc.inputs.hf_config.unread_keys`): a note on stderr, an
error with ``strict``.
"""

from __future__ import annotations

ROPE = "rotary frequencies (theta, scaling type and factors) are values: no tensor changes size"
ROUTER = "a routing value (scaling, normalisation, grouping): no tensor changes size"
AUX = "the router auxiliary loss: a scalar per layer (memcalc models the LM loss)"

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
    "initializer_range": "initialisation values",
    "rope_theta": ROPE, "rope_scaling": ROPE, "rope_parameters": ROPE, "rope_type": ROPE,
    "original_max_position_embeddings": ROPE,
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
    "router_aux_loss_coef": AUX, "output_router_logits": AUX, "router_jitter_noise": "a training-noise value",
    "norm_topk_prob": ROUTER, "routed_scaling_factor": ROUTER, "n_group": ROUTER, "topk_group": ROUTER,
    "topk_method": ROUTER, "scoring_func": ROUTER, "aux_loss_alpha": AUX, "seq_aux": AUX,
    "ep_size": "expert-parallel size of the original code (one GPU holds all experts here)",
    "_attn_implementation": "the attention kernel the checkpoint was saved with; memcalc's kernel profile "
                            "(--attention) sets the kernel of the estimate",
    "transformers.js_config": "a transformers.js export setting",
}
