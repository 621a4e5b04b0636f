"""What the estimate says about the techniques issue 14 added: activation offloading's host memory.

Kept apart from :mod:`memcalc.estimate.peak` so that each technique's report is one place: the
``extra`` keys (integer bytes, shown by ``--json``) and the assumption lines the text report prints.
"""

from __future__ import annotations

from memcalc.core.optimizers import BNB_PAGED_MIN_NUMEL, OPTIMIZERS
from memcalc.core.rules import MAX_FWD_STASH, MIN_OFFLOAD_BYTES
from memcalc.core.spec import ExperimentSpec
from memcalc.core.units import fmt_bytes
from memcalc.engine.result import SimResult


def technique_extra(steady: SimResult, first: SimResult) -> dict:
    """``extra`` entries: ``host_activation_bytes`` (the pinned host memory activation offloading
    needs, power-of-two blocks of PyTorch's caching host allocator), ``host_activation_raw_bytes``
    (the offloaded tensors' own bytes) and ``offloaded_tensors`` (per forward)."""
    out: dict = {}
    ho = [r.host_offload for r in (steady, first) if r.host_offload is not None]
    if ho:
        out["host_activation_bytes"] = max(h[1] for h in ho)
        out["host_activation_raw_bytes"] = max(h[0] for h in ho)
        out["offloaded_tensors"] = max(h[2] for h in ho)
    paged = [r.paged_state_bytes for r in (steady, first) if r.paged_state_bytes is not None]
    if paged:
        out["paged_optimizer_bytes"] = max(paged)
    return out


def technique_assumptions(exp: ExperimentSpec, steady: SimResult) -> list[str]:
    """The assumption lines of the techniques in use."""
    out: list[str] = []
    tr = exp.training
    if tr.activation_offload and steady.host_offload is not None:
        raw, pinned, n = steady.host_offload
        out.append(
            f"activation offloading (torchtune OffloadActivations, streams on): {n:,} saved tensors of at least "
            f"{MIN_OFFLOAD_BYTES} bytes per forward ({fmt_bytes(raw)}) go to pinned host memory, "
            f"{fmt_bytes(pinned)} in power-of-two host blocks (not in the GPU peak); the output head and the loss "
            f"keep theirs on the GPU; weight views saved by F.linear are offloaded too (no nn.Parameter); the "
            f"{MAX_FWD_STASH} latest offloaded tensors stay until their copy is done, and in backward each reloaded "
            "tensor lives until the next reloading node has run")
    if tr.lora is not None and tr.lora.dora:
        out.append(
            "DoRA as PEFT runs it (DoraLinearVariant / DoraLinearLayer.forward) for every framework: per target and "
            "forward an in x in identity through the adapters, a copy of W in the adapter input's dtype and "
            "W + s B A live until the layer's DoRA term is made; base and adapter outputs are saved for the "
            "magnitude's gradient (torchtune's DoRALinear makes the same tensors, in another order, and never "
            "recomputes the base output under dropout)")
    if OPTIMIZERS[tr.optimizer].paged and steady.paged_state_bytes is not None:
        out.append(
            f"{tr.optimizer}: {fmt_bytes(steady.paged_state_bytes)} of optimizer state (the moments of parameters of at "
            f"least {BNB_PAGED_MIN_NUMEL:,} elements) is paged: bitsandbytes allocates it with cudaMallocManaged, "
            "outside PyTorch's caching allocator, so max_memory_allocated and this peak do not include it; it "
            "occupies free GPU memory and pages to the host when the GPU runs short (the fits check counts the "
            "peak only)")
    return out


def technique_notes(extra: dict) -> list[str]:
    """Short notes for memory the techniques need outside the GPU peak (the estimate's ``notes``)."""
    out = []
    if "host_activation_bytes" in extra:
        out.append(f"activation offloading needs {fmt_bytes(extra['host_activation_bytes'])} of pinned host memory "
                   f"({extra['offloaded_tensors']:,} saved tensors per forward); not in the GPU peak")
    if extra.get("paged_optimizer_bytes") == 0:
        out.append(f"the paged optimizer pages nothing here: every trainable tensor has fewer than "
                   f"{BNB_PAGED_MIN_NUMEL:,} elements (bitsandbytes pages only larger ones), so its state is "
                   "ordinary GPU memory, in the peak")
    elif "paged_optimizer_bytes" in extra:
        out.append(f"{fmt_bytes(extra['paged_optimizer_bytes'])} of paged optimizer state lives in CUDA unified memory, "
                   "outside the GPU peak: resident in free GPU memory, paged to the host when short")
    return out
