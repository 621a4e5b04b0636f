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


# ---- unsloth_fused_ce_loss (unsloth_zoo/fused_losses/cross_entropy_loss.py -> fused_linear.py) ----
# With the defaults (UNSLOTH_CHUNKED_CE=1, UNSLOTH_FUSED_LINEAR=1) ``unsloth_fused_ce_loss`` calls
# ``_chunked_ce`` -> chunked_logprob.py ``unsloth_chunked_ce_loss`` -> fused_linear.py
# ``fused_linear_cross_entropy`` -> ``torch.ops.unsloth_zoo.fused_linear_ce_v2`` (``_ce_impl``): the gradient taken
# in forward, one (R, V) row chunk of logits at a time.
#: ``_CHUNK_GB = 2.0`` (UNSLOTH_LOGPROB_CHUNK_GB): ``_budget_bytes`` = min(2.0, half the free memory) GiB; memcalc
#: takes 2.0 (the chunks are as large as Unsloth lets them be whenever 4 GiB were free at the first loss)
CE_CHUNK_GB = 2.0
#: ``_MAX_ROWS = 4096``, ``_MIN_LOGITS = 512 * 151936`` (fused_linear.py)
CE_MAX_ROWS = 4096
CE_MIN_LOGITS = 512 * 151936
#: ``_SPLIT_COLS = 16384``: ``_tiled_vocab(V)`` = more than two 16384-column splits
CE_SPLIT_COLS = 16384


def _pow2_at_most(x: float) -> int:
    """``_pow2`` (the next power of two) halved when above ``x``: the power of two at or below ``x`` (1 at least)."""
    p = 1 << max(math.ceil(math.log2(max(x, 1))), 0)
    return p // 2 if p > x else p


def ce_chunk_rows(n_rows: int, hidden: int, vocab: int, bytes_per_logit: int = 4,
                  budget_bytes: int = int(CE_CHUNK_GB * 1024 ** 3)) -> int:
    """``fused_linear_rows(n_rows, hidden_size, vocab_size, bytes_per_logit)``: the power of two at or below
    ``n_rows * hidden / vocab`` (as Liger), at least ``min_rows`` (the power of two at or below ``_MIN_LOGITS /
    vocab``, clamped to [512, 4096]) and at most 4096, then at most ``budget // (vocab * bytes_per_logit)`` (2 at
    least) and ``n_rows``. ``bytes_per_logit`` 4: fp32 logits (``_logits_mode`` on CUDA with bf16, sm >= 80)."""
    rows = _pow2_at_most(n_rows * hidden / max(vocab, 1))
    min_rows = min(max(_pow2_at_most(CE_MIN_LOGITS / max(vocab, 1)), 512), CE_MAX_ROWS)
    rows = min(max(rows, min_rows), CE_MAX_ROWS)
    rows = min(rows, max(budget_bytes // max(vocab * bytes_per_logit, 1), 2))
    return max(min(rows, max(n_rows, 1)), 1)


def ce_buffer_bytes(rows: int, vocab: int, bytes_per_logit: int = 4) -> int:
    """``_Buffers(R, V, ...)``: one ``(R, stride)`` logits buffer reused by every chunk, ``stride`` = V rounded up
    to a multiple of 8, fp32 (``fp32_logits``)."""
    return rows * -(-vocab // 8) * 8 * bytes_per_logit


#: the kernel-level trace of Unsloth's LoRA Functions (memcalc.validate.unsloth_kernels)
KERNEL_TRACE = "tests/trace/test_unsloth_kernels.py"

#: what the output says about an Unsloth estimate (``provenance``): each mechanism, read or traced
PROVENANCE: tuple[tuple[str, str, str], ...] = (
    ("gradient checkpointing", "read",
     "use_gradient_checkpointing='unsloth' = --checkpoint full: each layer input offloaded to host memory except "
     "the last (unsloth_zoo gradient_checkpointing.py UnslothCheckpointFunction), two GPU staging buffers"),
    ("loss", "read",
     "unsloth_fused_ce_loss -> fused_linear_ce_v2 (unsloth_zoo fused_losses/fused_linear.py _ce_impl): the hidden "
     "states' gradient made in forward and saved, one fp32 (R, V) logits buffer, R = fused_linear_rows for a 2 GiB "
     "budget; its tiled no-buffer forward (frozen head, vocabulary over 32768, sm >= 80) is not modelled: the "
     "estimate keeps the buffer there (Triton, not traced)"),
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
    ("MoE experts", "not Unsloth's",
     "memcalc's transformers rules stand in for Unsloth's grouped-GEMM MoE kernels (unsloth/kernels/moe)"),
)

#: the one line the output prints
PROVENANCE_NOTE = (f"framework unsloth: Unsloth's step is not traced (its model forward, offloading checkpoint and "
                   f"Triton loss need CUDA); its LoRA kernels are traced on meta ({KERNEL_TRACE}), every other "
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
        if name == "MoE experts" and exp.model.moe is None:
            continue
        mechanisms.append({"mechanism": name, "how": how, "rule": rule})
    return {"framework": "unsloth", "source": UNSLOTH_VERSION,
            "traced": [m["mechanism"] for m in mechanisms if m["how"] == "traced"],
            "note": PROVENANCE_NOTE, "mechanisms": mechanisms}


#: ``memcalc validate --framework unsloth``: the one line (exit 2) saying what is not traced
UNTRACED = ("validate --framework unsloth: Unsloth's step cannot be traced (its model forward, offloading "
            "checkpoint and Triton fused loss need CUDA; without a GPU, import unsloth takes its CPU "
            f"fallback); only its LoRA kernels are, on meta, by {KERNEL_TRACE} (memcalc.validate.unsloth_kernels), "
            "equal to the estimate's to the byte; the rest of memcalc estimate --framework unsloth is read from "
            f"{UNSLOTH_VERSION} source (docs/unsloth.md)")
