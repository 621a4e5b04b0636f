"""What several of the replica's blocks use: dropout as CUDA runs it."""

from __future__ import annotations

import torch


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``native_dropout`` explicitly: the saved mask is bool (1 byte/element, as on CUDA:
    ``memcalc.core.kernels.DROPOUT_MASK_BYTES``)."""
    if p <= 0 or not training:
        return x
    return torch.native_dropout(x, p, True)[0]
