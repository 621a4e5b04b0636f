"""The decoder as composed blocks: one module per part, each holding the part's parameter rule (the
names, shapes and dtypes it contributes to :func:`memcalc.engine.params.param_inventory`) and its
forward rule (what it allocates and saves, op by op, on the walk
:class:`memcalc.engine.context.ForwardContext`); :class:`memcalc.engine.forward.Forward` is the
walk that composes them.

- :mod:`.embedding`: token (and learned position) embeddings, their scale and dropout;
- :mod:`.norm`: RMSNorm / LayerNorm;
- :mod:`.attention` (plain attention, the dispatch to the variants) with
  :mod:`.attention_variants` (fused qkv, q/k norms, eager attention, masks) and :mod:`.mla`
  (multi-head latent attention);
- :mod:`.mlp` (dense, fused gate_up) and :mod:`.moe` (router, grouped experts, shared experts);
- :mod:`.layer`: one decoder layer (norm placements, residuals, multipliers);
- :mod:`.adapters`: a projection with its LoRA / DoRA / QLoRA adapter;
- :mod:`.head`: final norm, the output head, logit post-processing, the loss;
- :mod:`.base`: what the parameter rules return (:class:`~.base.ParamTensor`);
  :mod:`.notes`: the estimate's notes on the MoE and MLA blocks.

The PyTorch twin of each block is under ``validate/`` (``validate/layers.py``,
``validate/attention.py``, ``validate/mla.py``, ``validate/moe.py``, ``validate/loss.py``,
composed by ``validate/model.py``); ``tests/unit/test_blocks.py`` is the contract of each block. This
package imports none of its modules (the engine's modules form no import cycle).
"""
