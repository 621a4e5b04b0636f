"""Cut Cross-Entropy on the real Hugging Face step, traced on ``meta``: cut_cross_entropy 25.1.1's Python
(``linear_cross_entropy`` -> ``cce.py`` ``cce_linear_cross_entropy`` -> ``LinearCrossEntropyFunction``: its
forward's LSE, logit average and gathered dot, its backward's ``torch.zeros_like`` gradient buffers, lock tensors
and vocabulary ordering) runs unmodified; only its Triton launches are no-ops, with the CUDA view of
:func:`.hf_liger.liger_trace` (shared).

The patch is ``cut_cross_entropy.transformers.cce_patch(model)`` (apple/ml-cross-entropy 1f3ebdb, 24.12.1:
the 25.1.1 wheel does not ship that package, and its ``cce_forward`` imports docstring constants transformers 5
no longer has): ``model.forward = MethodType(cce_forward, model)`` on the CausalLM, whose body is
``outputs = self.model(...)``, ``hidden_states = outputs[0]``, ``loss = linear_cross_entropy(hidden_states,
self.lm_head.weight, labels.to(hidden_states.device), shift=True, impl=_PATCH_OPTS.impl,
reduction=_PATCH_OPTS.reduction)`` (``impl="cce"``, ``reduction="mean"``: ``cce_patch``'s defaults) and a
``CausalLMOutputWithPast`` with ``logits=None``. :func:`apply_cce` sets exactly that forward (written against
transformers 5.24's decoder call). ``filter_eps`` is ``linear_cross_entropy``'s default (``"high"``), so the
forward returns the logit average and the backward sorts it (``sort_logit_avg``, a ``torch.compile``'d
``argsort(...).to(int32)``, run eagerly here: ``torch.compiler.set_stance("force_eager")`` around the step).

``.nonzero()`` of a meta tensor (``utils.py`` ``_build_flat_valids``: the positions whose label is not -100)
answers as if every element were nonzero (:class:`.hf_liger.MetaValues`): the harness' labels are the input ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import MethodType

from memcalc.core.cce import check_cce, check_cce_model_type


def check_cce_setup(exp, model_type: str) -> None:
    """A one-line UserError for a family or setup outside what memcalc models (memcalc.core.cce, shared)."""
    check_cce_model_type(model_type)
    check_cce(exp.model, exp.training)


def cce_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, cache_position=None, **kwargs):
    """``cut_cross_entropy/transformers/llama.py`` ``cce_forward`` (the same in mistral.py and phi3.py) with
    ``_PATCH_OPTS = PatchOptions(impl="cce", reduction="mean")``."""
    from cut_cross_entropy import linear_cross_entropy  # type: ignore[import-untyped]
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         cache_position=cache_position, **kwargs)
    hidden_states = outputs[0]
    loss = None
    if labels is not None:
        loss = linear_cross_entropy(hidden_states, self.lm_head.weight, labels.to(hidden_states.device),
                                    shift=True, impl="cce", reduction="mean")
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def apply_cce(model) -> None:
    """``cce_patch(model)`` on the CausalLM (under PEFT, the wrapped base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.forward = MethodType(cce_forward, base)


@contextlib.contextmanager
def cce_trace(model_type: str) -> Iterator[None]:
    """:func:`.hf_liger.liger_trace` (the Triton launches no-ops, the CUDA view, the meta values) with dynamo
    disabled (``sort_logit_avg`` runs its eager body)."""
    import torch

    from .hf_liger import liger_trace

    with torch.compiler.set_stance("force_eager"), liger_trace(model_type):
        yield
