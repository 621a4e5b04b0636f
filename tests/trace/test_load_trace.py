"""The load phase (memcalc.engine.loading) against the libraries' own loaders traced on meta
(memcalc.validate.loading): bitsandbytes 0.50's quantize_4bit and torchao 0.14's to_nf4 one weight
at a time, torchtune 0.6.1's whole QLoRA set-up (build + load_state_dict), and transformers 5.24's
4-bit from_pretrained loop with PEFT's kbit preparation and LoRA. Scaled-down models, under a second
a row (the first transformers row pays the library imports).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("torchtune")
pytest.importorskip("bitsandbytes")

from memcalc.core.spec import ExperimentSpec, TrainingSpec  # noqa: E402
from memcalc.engine.loading import _summary, bnb_quantize_steps, load_phase, torchao_to_nf4_steps  # noqa: E402
from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.inputs.profiles import profile_for  # noqa: E402
from memcalc.validate.loading import LoadTracer, trace_hf_load, trace_torchtune_load  # noqa: E402

#: |estimate - trace| / trace of a whole load, percent (issue 28: within 2%); measured torchtune
#: +0.001..+0.005% (the 512-byte NF4 table torch.tensor makes on CUDA, which the meta trace does not
#: see), transformers 0.000..+0.055% (bitsandbytes' 1 KiB dynamic map, made once per process: the
#: estimate counts it in every load, the trace only in the process's first)
LOAD_TOLERANCE_PCT = 2.0
#: the NF4 table (16 bf16 values, one 512-byte block) of each to_nf4, counted by the estimate only
NF4_TABLE_BYTES = 512


# (rows, columns): one block-aligned weight, an odd one for bitsandbytes, two torchao chunks
SHAPES = [(256, 512), (96, 320), (2048, 1024)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("dq", [False, True], ids=["nf4", "nf4-dq"])
def test_bnb_quantize_4bit_steps_equal_the_trace(shape, dq):
    """source: bitsandbytes 0.50.2 functional.quantize_4bit on meta (fake kernels); exact."""
    import bitsandbytes.functional as F

    n = shape[0] * shape[1]
    F.quantize_4bit(torch.empty(64, dtype=torch.bfloat16, device="meta"), compress_statistics=True)  # name2qmap made
    w = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    tr = LoadTracer("meta")
    tr.track([w])
    with tr:
        keep = F.quantize_4bit(w, blocksize=64, compress_statistics=dq, quant_type="nf4")
    base = w.untyped_storage().nbytes()
    top, stays = _summary(bnb_quantize_steps(n, 64, dq), 512)
    assert (tr.record.bytes - base, tr.current - base) == (top, sum(b for _, b in stays)), keep[0].shape


@pytest.mark.parametrize("shape", SHAPES[::2], ids=[f"{r}x{c}" for r, c in SHAPES[::2]])
def test_torchao_to_nf4_steps_equal_the_trace(shape):
    """source: torchao 0.14.1 to_nf4 on meta; exact but for the NF4 table the trace cannot see."""
    from torchao.dtypes.nf4tensor import to_nf4

    n = shape[0] * shape[1]
    w = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    tr = LoadTracer("meta")
    tr.track([w])
    with tr:
        keep = to_nf4(w)
    base = w.untyped_storage().nbytes() - NF4_TABLE_BYTES
    top, stays = _summary(torchao_to_nf4_steps(n, 2), 512)
    assert (tr.record.bytes - base, tr.current - base) == (top, sum(b for _, b in stays))
    assert keep.shape == shape


_SMALL = {"n_layers": 2, "d_model": 256, "n_heads": 4, "n_kv_heads": 2, "d_ff": 512, "vocab_size": 1024,
          "max_seq_len": 256}
# (id, preset, shape changes, LoRA targets); source: torchtune 0.6.1 qlora builders traced on meta
TORCHTUNE_ROWS = [
    ("tied all", "llama-3.2-1b", _SMALL, ("q", "k", "v", "o", "gate", "up", "down")),
    ("tied qv", "llama-3.2-1b", _SMALL, ("q", "v")),
    ("untied qv 2-chunk mlp", "llama-3.1-8b", {**_SMALL, "d_model": 1024, "n_heads": 8, "d_ff": 1536}, ("q", "v")),
]


@pytest.mark.parametrize("preset,update,targets", [r[1:] for r in TORCHTUNE_ROWS], ids=[r[0] for r in TORCHTUNE_ROWS])
def test_torchtune_qlora_load_within_tolerance(preset, update, targets):
    tr = {"batch": 1, "seq": 128, "precision": "bf16",
          "lora": {"rank": 8, "alpha": 16, "targets": targets, "qlora": True}}
    exp = ExperimentSpec(model=load_preset(preset).model_copy(update=update), training=TrainingSpec.model_validate(tr),
                         profile=profile_for("torchtune"))
    traced = trace_torchtune_load(exp).record
    est = load_phase(exp)
    gap = (est.peak_bytes - traced.bytes) / traced.bytes * 100
    assert abs(gap) <= LOAD_TOLERANCE_PCT, f"estimate {est.peak_bytes:,} B, trace {traced.bytes:,} B ({gap:+.3f}%)"
    assert traced.label == "load_state_dict" and est.peak_label.startswith("load_state_dict")


# (id, preset, shape changes, LoRA targets, PEFT's prepare_model_for_kbit_training); source:
# transformers 5.24 + bitsandbytes 0.50 + PEFT 0.21 traced on meta
HF_ROWS = [
    ("tied all kbit", "llama-3.2-1b", _SMALL, ("q", "k", "v", "o", "gate", "up", "down"), True),
    ("tied qv kbit vocab 4096", "llama-3.2-1b", {**_SMALL, "vocab_size": 4096}, ("q", "v"), True),
    ("untied qv kbit", "llama-3.1-8b", _SMALL, ("q", "v"), True),
    ("untied qv", "llama-3.1-8b", _SMALL, ("q", "v"), False),
]


@pytest.mark.parametrize("preset,update,targets,kbit", [r[1:] for r in HF_ROWS], ids=[r[0] for r in HF_ROWS])
def test_hf_qlora_load_within_tolerance(preset, update, targets, kbit):
    tr = {"batch": 1, "seq": 128, "precision": "bf16",
          "lora": {"rank": 8, "alpha": 16, "targets": targets, "qlora": True}}
    exp = ExperimentSpec(model=load_preset(preset).model_copy(update=update), training=TrainingSpec.model_validate(tr),
                         profile=profile_for("hf").model_copy(update={"qlora_fp32_cast": kbit}))
    traced = trace_hf_load(exp).record
    est = load_phase(exp)
    gap = (est.peak_bytes - traced.bytes) / traced.bytes * 100
    assert abs(gap) <= LOAD_TOLERANCE_PCT, f"estimate {est.peak_bytes:,} B, trace {traced.bytes:,} B ({gap:+.3f}%)"
    assert est.peak_label.startswith("prepare_model_for_kbit_training" if kbit else "quantizing")
