"""Unsloth (``--framework unsloth``): the rules memcalc reads from Unsloth's source, shared by the engine
(:mod:`memcalc.engine.unsloth_checkpoint`, :mod:`memcalc.engine.blocks.unsloth_head`,
:mod:`memcalc.engine.blocks.unsloth_lora`) and the output's provenance lines.

Source: the PyPI wheels unsloth 2026.10.9 and unsloth_zoo 2026.10.9 (``pip download unsloth unsloth_zoo
--no-deps``), read file by file; every rule below names its file and function. Unsloth's step is not traced:
its model forward, offloading checkpoint (CUDA streams) and torch.compile'd loss need CUDA, and on a machine
without a GPU ``import unsloth`` takes its CPU fallback (unsloth/_cpu_init.py: "no GPU found, training on CPU"),
which does not run the code modelled here. Its LoRA Functions are traced on meta (:data:`KERNEL_TRACE`).
:data:`PROVENANCE` says which is which in every estimate's output.
"""

from __future__ import annotations

import math

#: the wheels read
UNSLOTH_VERSION = "unsloth 2026.10.9 + unsloth_zoo 2026.10.9"

# ---- use_gradient_checkpointing="unsloth" (unsloth_zoo/gradient_checkpointing.py) ----
#: ``initialize_unsloth_gradient_checkpointing``: ``MINIMUM_SIZE = 2 * 1024 * 1024``; a layer input of at most
#: this many bytes (``arg.numel() * store_dtype.itemsize``) is kept on the GPU (``UnslothCheckpointFunction.forward``:
#: ``if new_size > MINIMUM_SIZE and ...``)
GC_MIN_OFFLOAD_BYTES = 2 * 1024 * 1024
#: ``INITIAL_GPU_BUFFER_SIZE = 2 * 256 * 2048`` elements of the buffer dtype (bf16 or fp16): each staging buffer's
#: first size; ``GPU_BUFFER.resize_(gpu_numel)`` grows it to one layer input when that is larger
GC_INITIAL_GPU_BUFFER_ELEMENTS = 2 * 256 * 2048
#: ``apply_unsloth_gradient_checkpointing`` (unsloth/models/_utils.py): below ``max_seq_length`` 512 "unsloth" falls
#: back to ``True`` (plain reentrant checkpointing, nothing offloaded)
GC_MIN_SEQ = 512


def gc_offloads(layer: int, n_layers: int, input_bytes: int) -> bool:
    """Whether ``UnslothCheckpointFunction.forward`` offloads layer ``layer``'s input to host memory in a step
    after the first: ``new_size > MINIMUM_SIZE and ((CURRENT_GC_INDEX != LAST_GC_INDEX) or FIRST_PASS)``;
    ``LAST_GC_INDEX`` counts the first pass's checkpoints, so the last layer's input stays on the GPU ("Don't
    offload the last layer - uses more VRAM and is slower", torchtune PR 1443)."""
    return input_bytes > GC_MIN_OFFLOAD_BYTES and layer != n_layers - 1


def gc_buffer_bytes(input_bytes: int, itemsize: int = 2) -> int:
    """One GPU staging buffer (``GPU_BUFFERS`` / ``GPU_BUFFERS_B``): ``_new_gpu_buffer`` allocates
    :data:`GC_INITIAL_GPU_BUFFER_ELEMENTS`, ``resize_`` grows it to ``ceil(new_size / element_size)``."""
    return itemsize * max(GC_INITIAL_GPU_BUFFER_ELEMENTS, -(-input_bytes // itemsize))


# ---- unsloth_fused_ce_loss (unsloth_zoo/fused_losses/cross_entropy_loss.py) ----
#: ``_CE_BYTES_PER_LOGIT = 16.0``: Unsloth's own count per (token x vocab) element of one chunk's eager chain
#: ("bf16 logits + float32 upcast + saved log_softmax + backward gradient = 14, and 16 under softcapping"); the
#: chunk runs under torch.compile (``torch_compile = True``), whose buffers memcalc cannot trace here, so the
#: chunk's transient is this count, as Unsloth sizes its chunks by it
CE_BYTES_PER_LOGIT = 16
#: the breakdown in that comment without softcapping: bf16 logits 2 + fp32 upcast 4 + log_softmax 4 + gradient 4
CE_CHUNK_BYTES_PER_LOGIT = 14
#: ``_CE_TARGET_GB_CAP = 4.0``: ``_free_target_gb`` = ``min(_default_target_gb(device), 4.0)``, where
#: ``_default_target_gb`` (unsloth_zoo/tiled_mlp.py) is half the GPU's free memory at the first loss call
#: (``_measured_target_gb`` is cached). memcalc takes the cap: the chunks are as large as Unsloth lets them be
#: whenever at least 8 GiB were free then.
CE_TARGET_GB = 4.0


def ce_chunks(rows: int, vocab: int, fixed_bytes: int, target_gb: float = CE_TARGET_GB) -> int:
    """``get_chunk_size(bsz, qlen, vocab_size, target_gb=None, fixed_gb)``: ``_get_chunk_multiplier`` takes
    ``fixed_gb`` (``grad_inputs`` plus twice a trainable head's gradient, ``UnslothFusedLoss.forward``) off the
    target when it is smaller; ``exact = rows * vocab * 16 / 2**30 / target``; one chunk when ``exact <= 1``,
    else ``ceil(exact / 4) * 4`` chunks, at most ``rows``."""
    gib = 1024 ** 3
    fixed_gb = fixed_bytes / gib
    if 0.0 < fixed_gb < target_gb:
        target_gb -= fixed_gb
    exact = rows * vocab * CE_BYTES_PER_LOGIT / gib / target_gb
    if exact <= 1.0 + 1e-9:
        return 1
    return min(math.ceil(exact / 4 - 1e-9) * 4, rows)


def ce_chunk_rows(rows: int, chunks: int) -> int:
    """The largest chunk: ``CHUNK_ALIGN_ROWS = 0`` by default (temporary_patches/common.py), so
    ``chunk_row_bounds`` returns None and ``torch.chunk`` splits the rows: ``ceil(rows / chunks)``."""
    return -(-rows // chunks)


#: the kernel-level trace of Unsloth's LoRA Functions (memcalc.validate.unsloth_kernels)
KERNEL_TRACE = "tests/trace/test_unsloth_kernels.py"

#: what the output says about an Unsloth estimate (``provenance``): each mechanism, read or traced
PROVENANCE: tuple[tuple[str, str, str], ...] = (
    ("gradient checkpointing", "read",
     "use_gradient_checkpointing='unsloth' = --checkpoint full: each layer input offloaded to host memory except "
     "the last (unsloth_zoo gradient_checkpointing.py UnslothCheckpointFunction), two GPU staging buffers"),
    ("loss", "read",
     "unsloth_fused_ce_loss: grad_inputs kept from forward, chunks sized for a 4 GB target, 14 bytes per logit "
     "(unsloth_zoo fused_losses/cross_entropy_loss.py; torch.compile'd, not traced)"),
    ("LoRA", "traced",
     "fast_lora LoRA_QKV / LoRA_W / LoRA_MLP where patch_peft_model installs them, run unmodified on meta (Triton "
     f"launches no-ops): saved bytes and forward / backward peaks equal to the byte ({KERNEL_TRACE}); adapters fp32 "
     "(unsloth_zoo training_utils.py, read)"),
    ("4-bit dequantisation", "read",
     "fast_dequantize: forward into one global buffer of the largest weight (kernels/utils.py), backward afresh "
     "(bitsandbytes' CUDA kernels through ctypes: not traced)"),
    ("RMSNorm", "read", "Fast_RMS_Layernorm saves X, W and fp32 rstd (the fused rule)"),
    ("attention and RoPE", "not Unsloth's",
     "memcalc's transformers rules stand in for Unsloth's attention dispatch and in-place RoPE kernel "
     "(docs/unsloth.md)"),
)

#: the one line the output prints
PROVENANCE_NOTE = (f"framework unsloth: Unsloth's step is not traced (its model forward, offloading checkpoint and "
                   f"compiled loss need CUDA); its LoRA kernels are traced on meta ({KERNEL_TRACE}), every other "
                   f"Unsloth number is read from its source ({UNSLOTH_VERSION}); see docs/unsloth.md")


def provenance(exp) -> dict:
    """The ``provenance`` of an Unsloth estimate (``--json``; the table prints it as assumption lines): which
    mechanism is traced and which read from source, with the rule memcalc applies in this setup."""
    tr = exp.training
    lora = tr.lora
    mechanisms = []
    for name, how, rule in PROVENANCE:
        if name == "gradient checkpointing":
            if tr.checkpoint != "full":
                continue
            if tr.seq < GC_MIN_SEQ:
                rule = (f"--seq {tr.seq} < {GC_MIN_SEQ}: apply_unsloth_gradient_checkpointing falls back to plain "
                        "reentrant checkpointing (nothing offloaded)")
        if name in ("LoRA", "4-bit dequantisation") and lora is None:
            continue
        if name == "4-bit dequantisation" and not lora.qlora:  # type: ignore[union-attr]
            continue
        mechanisms.append({"mechanism": name, "how": how, "rule": rule})
    return {"framework": "unsloth", "source": UNSLOTH_VERSION,
            "traced": [m["mechanism"] for m in mechanisms if m["how"] == "traced"],
            "note": PROVENANCE_NOTE, "mechanisms": mechanisms}


#: ``memcalc validate --framework unsloth``: the one line (exit 2) saying what is not traced
UNTRACED = ("validate --framework unsloth: Unsloth's step cannot be traced (its model forward, offloading "
            "checkpoint and torch.compile'd fused loss need CUDA; without a GPU, import unsloth takes its CPU "
            f"fallback); only its LoRA kernels are, on meta, by {KERNEL_TRACE} (memcalc.validate.unsloth_kernels), "
            "equal to the estimate's to the byte; the rest of memcalc estimate --framework unsloth is read from "
            f"{UNSLOTH_VERSION} source (docs/unsloth.md)")
