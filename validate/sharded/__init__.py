"""Sharded steps (FSDP2, FSDP1) traced one rank at a time on PyTorch's fake process group.

``trace_rank(exp, rank=0, scale_layers=None, timeline=False) -> dict`` (``runner.py``) is the
entry point; ``lifetimes(trace)`` (``lifetimes.py``) reads each storage's birth and death from a timeline;
``fake_dist.py`` (the fake world and its device meshes), ``rank_tracer.py`` (the
allocation counter), ``fsdp2.py`` / ``fsdp1.py`` (how the model is wrapped), ``command.py`` (the
records of ``memcalc validate --gpus N --zero {2,3} --sharding {fsdp2,fsdp1}``).
"""

from .lifetimes import lifetimes
from .runner import TRACED, check_sharded, trace_rank

__all__ = ["TRACED", "check_sharded", "lifetimes", "trace_rank"]
