"""The embeddings: token embedding (vocabulary-parallel under tensor parallelism), the
``embedding_scale`` multiplier, learned positions, and the embedding dropout; their parameters
(``embed_tokens``, ``embed_positions``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.rules import input_require_grads
from memcalc.core.spec import ModelSpec
from memcalc.engine.blocks.base import ParamTensor, scaled

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext
    from memcalc.engine.records import T


def embedding_params(m: ModelSpec, full: bool, save: tuple[str, ...] = ()) -> list[ParamTensor]:
    """The token embedding (vocab x d) and, with learned positions, the position embedding. With
    ``embed_tokens`` in PEFT's ``modules_to_save`` (``save``): the original embedding stays, frozen
    (``embed_tokens.original_module``), and the one the forward uses is PEFT's trainable copy
    (peft 0.21 utils/other.py ``ModulesToSaveWrapper.update``: ``copy.deepcopy(self.original_module)``,
    the base's dtype; ``_forward_wrapped`` calls the copy)."""
    d = m.d_model
    out = []
    if "embed_tokens" in save:
        out.append(ParamTensor(ORIGINAL_EMBED, (m.vocab_size, d), None, False, "embedding"))
    out.append(ParamTensor("embed_tokens.weight", (m.vocab_size, d), None, full or "embed_tokens" in save, "embedding"))
    if m.positions == "learned":
        out.append(ParamTensor("embed_positions.weight", (m.max_seq_len, d), None, full, "embedding"))
    return out


#: the frozen original of an embedding in ``modules_to_save`` (with tied embeddings, the head's weight)
ORIGINAL_EMBED = "embed_tokens.original_module.weight"


def embed(fwd: ForwardContext, ids: T) -> T:
    """The embeddings of the token ids ``ids`` (scaled, plus learned positions); a new reference."""
    o, m = fwd.ops, fwd.m
    w = fwd.p("embed_tokens.weight")
    x = o.embedding(ids, fwd.rows, w, m.d_model)
    if input_require_grads(o.profile.framework, fwd.tr.checkpoint, w.trainable):  # a leaf requiring grad
        x.requires_grad = True
        fwd.input_leaf = fwd.sim.ref(x)  # its AccumulateGrad's reference (Forward.release_inputs)
    if fwd.tp:  # vocabulary-parallel embedding: its Partial output reduced
        x = fwd.tp.reduce(fwd, x)
    x = scale_embeddings(fwd, x)
    pos = fwd.maybe("embed_positions.weight")
    if pos is not None:
        pe = o.embedding(ids, fwd.T, pos, m.d_model)
        x2 = o.add(x, pe)
        o.drop(x, pe)
        x = x2
    return x


def scale_embeddings(fwd: ForwardContext, x: T) -> T:
    """The embeddings times ``embedding_scale`` (a new tensor when the scale is not 1)."""
    return scaled(fwd, x, fwd.m.embedding_scale)


def embed_dropout(fwd: ForwardContext, x: T) -> T:
    """The embedding dropout (``embd_dropout``) on ``x`` (takes the reference)."""
    y = fwd.ops.dropout(x, fwd.m.embd_dropout)
    fwd.ops.drop(x)
    return y
