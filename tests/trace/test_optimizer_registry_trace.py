"""The optimizer registry (memcalc.core.optimizers) against the validator: every record the spec accepts
is built and stepped by ``validate/optim.py`` (slow, torch; the estimator's side is
``tests/unit/test_optimizer_registry.py``)."""

from __future__ import annotations

import pytest

from memcalc.core.optimizers import DEFAULT_IMPL, OPTIMIZER_NAMES, OPTIMIZERS
from memcalc.core.spec import TrainingSpec

#: every (optimizer, implementation) the spec accepts (as tests/unit/test_optimizer_registry.py)
VALID = [(n, i) for n in OPTIMIZER_NAMES for i in sorted({DEFAULT_IMPL, *OPTIMIZERS[n].impls})]


@pytest.mark.slow  # needs torch
def test_validate_builds_every_optimizer() -> None:
    torch = pytest.importorskip("torch")
    from memcalc.validate.optim import BUILDERS, allow_fused_on, build_optimizer, optimizer_tensors

    assert list(BUILDERS) == list(OPTIMIZER_NAMES)
    for name, impl in VALID:
        for master in (False, True):
            if master and OPTIMIZERS[name].step == "galore":
                continue  # the spec refuses GaLore with master weights (TrainingSpec._check_galore)
            tr = TrainingSpec(optimizer=name, optimizer_impl=impl, precision="bf16" if master else "fp32",
                              master_weights=master)
            dtype = torch.bfloat16 if master else torch.float32
            lin = torch.nn.Linear(64, 128, device="meta", dtype=dtype)
            params = list(lin.parameters())
            for p in params:
                p.grad = torch.zeros_like(p)
            with allow_fused_on("meta"):
                opt = build_optimizer(params, tr)
                try:
                    opt.step()
                except NotImplementedError as e:  # torch has no meta kernel for _fused_sgd_ (fused, or master steps)
                    assert name.startswith("sgd") and (impl == "fused" or master) and "_fused_sgd" in str(e)
                    continue
            big = [t for t in optimizer_tensors(opt) if t.numel() > 1]
            assert bool(big) == (OPTIMIZERS[name].state != "none" or master), (name, impl, master)
