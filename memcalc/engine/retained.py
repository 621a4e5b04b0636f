"""Tensors a graph keeps alive outside autograd's saved variables (bitsandbytes < 0.43.2 ``MatMul4Bit``).

bitsandbytes 0.41-0.43.1 ``MatMul4Bit.forward`` (autograd/_functions.py) keeps its input on the
``ctx`` (``ctx.tensors = (A, B)``) instead of ``ctx.save_for_backward``; PyTorch frees after a node's
backward only what ``save_for_backward`` saved (torch/csrc/autograd/python_function.cpp
``PyNode::release_variables`` clears ``saved_variables``), so each such input lives as long as the
graph does: to the end of backward where the trainer drops the loss, or, in LitGPT's ``fit`` (whose
``logits`` hold the graph), until the next micro-step's ``model(...)`` returns
(:mod:`memcalc.engine.blocks.litgpt_head`). bitsandbytes PR 1270 (0.43.2) keeps only the weight.
"""

from __future__ import annotations

from memcalc.engine.sim import T


class Retained:
    """The distinct tensors one micro-step's graph keeps (a reference each)."""

    def __init__(self) -> None:
        self.tensors: list[T] = []
        self._ids: set[int] = set()

    def add(self, t: T) -> None:
        """Keep ``t`` with the graph, once (a second 4-bit linear on the same input adds nothing)."""
        if id(t) not in self._ids:
            assert t.alive, f"reference to a freed tensor {t.name}"
            t.refs += 1
            self._ids.add(id(t))
            self.tensors.append(t)

    def __contains__(self, t: T) -> bool:
        return id(t) in self._ids

    def take(self) -> list[T]:
        """Hand the references over: whoever ends the graph unrefs them."""
        out, self.tensors, self._ids = self.tensors, [], set()
        return out

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
