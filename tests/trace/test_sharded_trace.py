"""One rank of an FSDP2 / FSDP1 step traced on PyTorch's fake process group (``memcalc.validate.sharded``).

Every trace here is a tiny model (d 128, 2 layers, vocab 1000, batch 2 x 64): a few seconds each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from conftest import one_line_error  # noqa: E402
from memcalc.core.errors import UserError  # noqa: E402
from memcalc.core.spec import ExperimentSpec, KernelProfile, ModelSpec, TrainingSpec  # noqa: E402
from memcalc.validate.sharded import lifetimes, trace_rank  # noqa: E402

TINY = ModelSpec(name="tiny-llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=4, d_ff=344, vocab_size=1000,
                 max_seq_len=1024)
#: the math kernel runs the same ops on real CPU tensors and on fake ones (the fused kernels exist on CUDA only)
MATH = KernelProfile(attention="math")


def tiny(gpus: int = 4, zero: int = 3, sharding: str = "fsdp2", profile: KernelProfile = MATH, **tr) -> ExperimentSpec:
    base = dict(batch=2, seq=64, gpus=gpus, zero=zero, sharding=sharding)
    base.update(tr)
    return ExperimentSpec(name="tiny", model=TINY, training=TrainingSpec(**base), profile=profile)


# -- the guard: fake tensors allocate what real ones do --------------------------------------
GUARD = [
    # (sharding, zero, training options); source: meta-trace-pitfalls.md, "a tiny model traced with real CPU
    # tensors and with fake tensors gives identical peaks"
    ("fsdp2", 3, {}),
    ("fsdp2", 2, {}),
    ("fsdp2", 3, dict(precision="bf16", master_weights=True)),  # MixedPrecisionPolicy over fp32 shards
    ("fsdp2", 3, dict(checkpoint="full")),
    ("fsdp1", 3, {}),
    ("fsdp1", 2, {}),
]


@pytest.mark.parametrize("sharding,zero,opts", GUARD)
def test_fake_tensors_allocate_what_real_cpu_tensors_do(sharding, zero, opts):
    exp = tiny(zero=zero, sharding=sharding, **opts)
    real = trace_rank(exp, rank=1, real=True)
    fake = trace_rank(exp, rank=1, cuda_kernels=False)  # the CPU kernels, as the real run takes
    assert real["unknown_resizes"] == fake["unknown_resizes"] == 0
    for key in ("peak_bytes", "first_step_bytes", "baseline_bytes", "phase", "phase_peaks"):
        assert fake[key] == real[key], key  # identical, not close


# -- what the trace shows ---------------------------------------------------------------------
def _unsharded_layer_bytes(dtype_bytes: int) -> int:
    """One decoder layer's parameters, unsharded, each rounded up to the allocator's 512-byte blocks."""
    d, f = TINY.d_model, TINY.d_ff
    shapes = [d * d] * 4 + [d * f] * 3 + [d] * 2  # q k v o, gate up down, two norms
    return sum(-(-n * dtype_bytes // 512) * 512 for n in shapes)


def test_zero2_keeps_every_layer_unsharded_through_forward():
    """FSDP2 reshard_after_forward=False (--zero 2) keeps each layer's unsharded parameters from its forward to
    its backward (torch/distributed/fsdp/_fully_shard/_fully_shard.py, fully_shard docstring): the forward's
    peak (at the head and loss, after every layer ran) is higher than --zero 3's by the unsharded layers."""
    z3 = trace_rank(tiny(zero=3, profile=KernelProfile()))
    z2 = trace_rank(tiny(zero=2, profile=KernelProfile()))
    assert z3["reshard_after_forward"] is True and z2["reshard_after_forward"] is False
    assert z2["baseline_bytes"] == z3["baseline_bytes"]  # the same shards and optimizer state
    gap = z2["phase_peaks"]["forward"] - z3["phase_peaks"]["forward"]
    layers = TINY.n_layers * _unsharded_layer_bytes(4)
    assert layers <= gap <= layers + 2 * _unsharded_layer_bytes(4) // TINY.n_layers, (gap, layers)
    assert z2["peak_bytes"] >= z2["phase_peaks"]["forward"] > z3["phase_peaks"]["forward"]


SHARDS = [
    # (gpus,); source: a DTensor parameter holds 1/N of the flat dim-0 chunks on each rank (FSDP2 Shard(0)); fp32
    # AdamW: 4 bytes of weights + 8 of moments per parameter, so the baseline is 12 * params / N plus the batch
    (2,), (4,), (8,),
]
SHARD_TOL = 0.02  # dim-0 chunks are padded to equal sizes and each storage is rounded to 512 bytes


@pytest.mark.parametrize("gpus", [g for (g,) in SHARDS])
def test_a_dtensor_counts_by_its_local_shard(gpus):
    r = trace_rank(tiny(gpus=gpus, profile=KernelProfile()))
    want = 12 * r["params"] / gpus
    assert abs(r["baseline_bytes"] - want) <= SHARD_TOL * want, (r["baseline_bytes"], want)


def test_timeline_labels_collectives_and_layers():
    r = trace_rank(tiny(profile=KernelProfile()), timeline=True)
    events = r["timeline"]
    assert all(kind in ("alloc", "free", "resize") for kind, *_ in events)
    labels = " | ".join(label for _, label, _, _ in events)
    for part in ("forward layer 0", "backward layer 1", "[all-gather", "[reduce-scatter]", "optimizer step"):
        assert part in labels, part
    assert max(live for *_, live in events) == r["peak_bytes"]
    # unsharded parameters are FSDP2's resized storages: each layer's grow at its all-gather copy-out and
    # shrink at its reshard; the root's (embedding, head) live from the first forward to the end of backward
    rows = [row for row in lifetimes(r) if row["op"] == "UntypedStorage.resize_"]
    assert rows and all(row["died"] is not None for row in rows)
    assert any(row["born"].startswith("forward") and row["died"].startswith("backward") for row in rows)
    assert r["phase"] in ("forward", "backward", "optimizer step") and r["label"]


def test_bad_setups_are_user_errors():
    with pytest.raises(UserError, match="valid: 2, 3"):
        trace_rank(tiny(zero=1))
    with pytest.raises(UserError, match="DeepSpeed"):
        trace_rank(tiny(), sharding="deepspeed")


# -- the CLI -----------------------------------------------------------------------------------
CLI = ["validate", "--model", "llama-2-7b", "--seq", "64", "--scale-layers", "1"]
BAD_CLI = [
    # (args, exit code, message)
    (CLI + ["--zero", "3"], 2, "--zero 3 needs --gpus N (N >= 2): validate traces one rank of a sharded step"),
    (CLI + ["--gpus", "1", "--sharding", "fsdp1"], 2, "--sharding fsdp1 needs --gpus N (N >= 2)"),
    (CLI + ["--gpus", "4", "--zero", "3", "--sharding", "ddp"], 2, "unknown --sharding 'ddp'; valid: fsdp2, fsdp1, deepspeed"),
    (CLI + ["--gpus", "4", "--zero", "3", "--sharding", "deepspeed", "--rank", "1"], 2,
     "--rank 1: the DeepSpeed trace runs rank 0"),
    (CLI + ["--gpus", "4", "--zero", "3", "--device", "cuda"], 2, "cannot measure 4 ranks on CUDA; trace one rank with --device meta"),
    (CLI + ["--gpus", "4"], 2, "--gpus 4 needs --zero 2 or 3"),
    # source: one GPU under --deepspeed is DeepSpeed's engine, traced as rank 0 of 1 on meta (issue 28)
    ([*CLI, "--deepspeed", str(Path(__file__).parent.parent / "traces" / "deepspeed" / "zero2.json"),
      "--device", "cuda"],
     2, "--deepspeed --device cuda: validate traces DeepSpeed's engine as one rank"),
    (CLI + ["--gpus", "4", "--zero", "1"], 2, "--gpus 4 needs --zero 2 or 3 for validate (got 1)"),
    (CLI + ["--gpus", "4", "--zero", "3", "--rank", "4"], 2, "--rank 4 is not a rank of --gpus 4 (valid: 0..3)"),
    (CLI + ["--rank", "1"], 2, "--rank 1 needs --gpus N (N >= 2)"),
    (CLI + ["--gpus", "4", "--zero", "3", "--compile"], 2, "--compile: the sharded trace runs eager"),
]


@pytest.mark.parametrize("args,code,message", BAD_CLI)
def test_cli_bad_sharded_input_is_one_line_exit_2(args, code, message):
    r = CliRunner().invoke(app, args)
    one_line_error(r, code, message)


def test_cli_traces_one_rank_and_writes_records(tmp_path):
    out = tmp_path / "r.json"
    args = ["validate", "--config", "control", "--seq", "64", "--batch", "1", "--scale-layers", "1",
            "--gpus", "4", "--zero", "2", "--sharding", "fsdp1", "--rank", "3", "--json", "--output", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(r.stdout)
    assert json.loads(out.read_text()) == [rec]
    assert rec["status"] == "ok", rec["reason"]
    assert (rec["sharding"], rec["gpus"], rec["zero"], rec["rank"], rec["strategy"]) == ("fsdp1", 4, 2, 3, "SHARD_GRAD_OP")
    assert isinstance(rec["measured_bytes"], int) and rec["measured_bytes"] > rec["baseline_bytes"] > 0
    assert rec["mixed_precision"].startswith("pure fp32") and rec["framework"] == "plain"


# -- the 2-D mesh for tensor parallelism --------------------------------------------------------
TP_MESHES = [
    # (dp, tp); source: ColwiseParallel shards a weight's rows (Shard(0)) and RowwiseParallel its columns
    # (Shard(1)) over "tp" (torch/distributed/tensor/parallel/style.py); fully_shard then shards dim 0 over "dp"
    (1, 4),
    (2, 2),
]


@pytest.mark.parametrize("dp,tp", TP_MESHES)
def test_a_2d_mesh_parallelized_module_counts_local_shards(dp, tp):
    import torch.nn as nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from memcalc.validate.sharded.fake_dist import fake_world
    from memcalc.validate.sharded.rank_tracer import RankTracer, local_tensors

    d, f = 256, 1024

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    with fake_world(dp * tp, rank=1, shape=(dp, tp), names=("dp", "tp")) as mesh:
        assert mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.shape) == (dp, tp)
        fake = FakeTensorMode()
        with fake, torch.device("meta"):
            model = MLP()
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if dp > 1:
            fully_shard(model, mesh=mesh["dp"])
        with fake:
            model.to_empty(device="cpu")
            x = torch.zeros(2, 64, d)
            tracer = RankTracer("cpu")
            tracer.track(local_tensors(model.parameters()))
            assert tracer.current == 2 * d * f * 4 // (dp * tp)  # each rank holds 1/(dp*tp) of the weights
            tracer.track([x])
            base = tracer.current
            tracer.timeline = []
            with tracer:
                model(x).square().mean().backward()
    ops = {e[5] for e in tracer.timeline if e[0] == "alloc"}
    assert "_c10d_functional.all_reduce.default" in ops  # RowwiseParallel's partial sum, seen as an op
    assert tracer.unknown_resizes == 0
    # the row-parallel output is the full (2, 64, d) activation on every rank; the up projection's is 1/tp
    assert tracer.record.bytes >= base + 2 * 64 * f * 4 // tp


HF_TOL = 0.005  # the replica follows the HF step's rules (profile "hf"); what is left is bookkeeping of a few storages


@pytest.mark.parametrize("zero", [3, 2])
def test_the_hugging_face_model_under_fsdp2_matches_the_replica(zero):
    """``framework="hf"``: transformers' LlamaForCausalLM under FSDP2 (validate/sharded/hf.py), traced like the
    replica; with the hf profile both run the same step, so their per-rank peaks agree."""
    from memcalc.inputs.resolve import Options, resolve

    exp = resolve(Options(model="llama-2-7b", framework="hf", batch=2, seq=64, gpus=4, zero=zero, bf16=True,
                          master_weights=True)).exp
    exp = exp.model_copy(update={"model": exp.model.model_copy(update=dict(
        n_layers=2, d_model=128, n_heads=4, n_kv_heads=4, d_ff=344, vocab_size=1000))})
    hf = trace_rank(exp, framework="hf")
    plain = trace_rank(exp, framework="plain")
    assert hf["framework"] == "hf" and hf["params"] == plain["params"]
    # transformers' LlamaRotaryEmbedding keeps a second buffer, original_inv_freq (modeling_llama.py): one block
    assert hf["baseline_bytes"] - plain["baseline_bytes"] == 512
    assert abs(hf["peak_bytes"] - plain["peak_bytes"]) <= HF_TOL * plain["peak_bytes"], (hf["peak_bytes"], plain["peak_bytes"])
