"""One rank of a DeepSpeed ZeRO-2/3 step, traced in one process without GPUs.

``trace_deepspeed(exp)`` runs DeepSpeed's own engine (``deepspeed.initialize``, ``engine(batch)``,
``engine.backward(loss)``, ``engine.step()``) as rank ``r`` of ``N`` on PyTorch's fake process
group (``torch.testing._internal.distributed.fake_pg``: collectives are no-ops, every buffer
they need is a real allocation) with DeepSpeed's CPU accelerator, on fake tensors
(``FakeTensorMode``: shapes and dtypes, no data). The model is memcalc's plain PyTorch replica
(:mod:`.model`); the optimizer is the client optimizer ``torch.optim.AdamW`` (foreach / for-loop
/ fused as ``--optimizer-impl`` says) over DeepSpeed's flat fp32 partitions. Everything the
process allocates from the model's construction on is counted by :class:`~.tracer.StorageTracer`
(512-byte rounding); two steps run, the second is measured.

The three patches DeepSpeed needs to run this way are in :func:`_patches` (one place, each
explained); the replica sees fake tensors as ``meta`` so that it picks the CUDA kernels
(:func:`_replica_sees_meta`). Each trace runs in a fresh subprocess (``python -m
memcalc.validate.deepspeed_trace``): the process group, DeepSpeed's communication backend and the
patches are process-wide.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Callable, Iterator, Optional

from memcalc.core.spec import DeepSpeedSpec, ExperimentSpec

from .step import Measurement, error_reason

#: the replica's modules: their device checks choose CUDA's kernels when they see ``meta``
REPLICA_MODULES = frozenset(f"memcalc.validate.{m}" for m in
                            ("attention", "layers", "model", "variants", "mla", "moe", "amp"))


def deepspeed_unsupported(exp: ExperimentSpec) -> Optional[str]:
    """Why this experiment cannot be traced under DeepSpeed (None when it can)."""
    tr = exp.training
    if tr.first_seq is not None:
        return ("first_seq (a longer first micro-batch) is traced by the single-process harnesses (validate/step.py "
                "run_on_device: the replica, hf, trl, litgpt), not under DeepSpeed")
    if tr.sharding != "deepspeed" or tr.zero not in (2, 3):
        return f"the DeepSpeed tracer runs ZeRO-2/3 with sharding deepspeed (got sharding {tr.sharding}, zero {tr.zero})"
    if tr.precision.startswith("amp-"):
        return "DeepSpeed runs fp32 or bf16/fp16 weights (bf16.enabled / fp16.enabled), not autocast (amp-*)"
    if tr.precision == "fp16":
        return "DeepSpeed's CPU accelerator, which the trace runs on, refuses fp16 (is_fp16_supported); bf16 and fp32 run"
    if tr.optimizer not in ("adamw", "adam"):
        return f"the DeepSpeed tracer runs AdamW / Adam (DeepSpeed's own optimizers), not {tr.optimizer}"
    if tr.lora is not None:
        return "the DeepSpeed tracer runs full fine-tuning (no LoRA)"
    if tr.fused_optimizer or tr.compile:
        return "the DeepSpeed tracer runs an eager step with the optimizer after backward"
    if tr.offload_optimizer:
        return "offload_optimizer steps on the host (DeepSpeedCPUAdam), which the trace does not run"
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:  # not imported here: it is slow and logs on import
        return "deepspeed is not installed (pip install 'memcalc[deepspeed]')"
    return None


def ds_config(exp: ExperimentSpec) -> dict:
    """The ``ds_config`` dict DeepSpeed is initialised with: the resolved ``DeepSpeedSpec`` (every
    "auto" already replaced), micro-batch and accumulation from the training spec, bf16 / fp16
    enabled as its precision says."""
    tr = exp.training
    ds = tr.deepspeed or DeepSpeedSpec(stage=tr.zero)
    zo: dict[str, object] = {"stage": ds.stage, "reduce_bucket_size": ds.reduce_bucket_size,
          "allgather_bucket_size": ds.allgather_bucket_size, "overlap_comm": ds.overlap,
          "contiguous_gradients": ds.contiguous_gradients, "stage3_prefetch_bucket_size": ds.prefetch_bucket_size,
          "stage3_max_live_parameters": ds.max_live_parameters, "stage3_max_reuse_distance": ds.max_reuse_distance,
          "stage3_param_persistence_threshold": ds.param_persistence_threshold}
    if ds.offload_param:  # offload_config.py DeepSpeedZeroOffloadParamConfig defaults (pin_memory true)
        zo["offload_param"] = {"device": "cpu", "pin_memory": True}
    # micro-steps after the second repeat it (as memcalc's timeline assumes): two run, the second is the boundary
    return {"train_micro_batch_size_per_gpu": tr.batch, "gradient_accumulation_steps": min(tr.grad_accum, 2),
            "zero_optimization": zo, "bf16": {"enabled": tr.precision == "bf16"},
            "fp16": {"enabled": tr.precision == "fp16"}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


@contextlib.contextmanager
def _patches() -> Iterator[None]:
    """The three changes DeepSpeed needs to run one rank on fake tensors. None allocates or
    frees anything: each replaces a value read or a check, not a buffer.

    1. ``assert_ints_same_as_other_ranks`` (deepspeed/runtime/zero/utils.py, imported by
       partitioned_param_coordinator.py, partition_parameters.py and stage3.py): ZeRO-3 checks
       that every rank traced the same module order by broadcasting the list length and
       reading it back with ``.item()``. Fake tensors have no data, so the check would read a
       value that was never there; with one process playing a rank there is nothing to compare.
       Its tensors are a few int64 scalars, freed at once.
    2. ``torch.nn.Module.to`` (called by engine.py ``_configure_distributed_model`` as
       ``self.module.to(self.device)``): the replica is built on the accelerator's device
       (``cpu``) already, so the move is a no-op; PyTorch would still swap each fake parameter
       for itself and fails ("Couldn't swap"). The patch returns the module unchanged, which
       is what a same-device ``to`` does.
    3. ``FakeTensor.item`` / ``FakeTensor.__bool__``: the overflow check (stage_1_and_2.py
       ``has_overflow``, stage3.py ``has_overflow``) and the gradient-norm check
       (runtime/utils.py ``is_invalid_grad_norm``) read a tensor's value with ``.item()`` /
       ``bool()``, which a fake tensor cannot give. The patch answers as a healthy step on a
       GPU does: no overflow (integer and bool tensors read 0, ``bool()`` is False) and a
       finite float (1.0, e.g. Adam's step count in its bias correction). The tensors of the
       checks are still made (and counted); only the read-back is answered.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    import deepspeed.runtime.zero.partition_parameters as pp
    import deepspeed.runtime.zero.partitioned_param_coordinator as ppc
    import deepspeed.runtime.zero.stage3 as s3

    saved: list[tuple[object, str, object]] = []

    def put(owner, name, value):
        saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    for mod in (ppc, pp, s3):
        if hasattr(mod, "assert_ints_same_as_other_ranks"):
            put(mod, "assert_ints_same_as_other_ranks", lambda ints: None)
    put(torch.nn.Module, "to", lambda self, *a, **k: self)
    put(FakeTensor, "item", lambda self: 1.0 if self.dtype.is_floating_point else 0)
    put(FakeTensor, "__bool__", lambda self: False)
    try:
        yield
    finally:
        for owner, name, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


_MISSING = object()


@contextlib.contextmanager
def _host_memory(tracer) -> Iterator[None]:
    """Host and device apart on DeepSpeed's CPU accelerator, where both are ``cpu``. Nothing is
    allocated or freed that would not be on CUDA; only where a buffer lives is said:

    - ``CPU_Accelerator.pin_memory`` (accelerator/cpu_accelerator.py) returns its tensor (nothing is
      page-locked there); DeepSpeed pins every host buffer it offloads to (partition_parameters.py
      ``_partition_param``: the partitions on ``remote_device`` cpu; stage3.py
      ``_create_param_groups_fp16_flat_cpu_memory``: the flat 16-bit partition buffers), so a pinned
      tensor's storage is marked host memory (:meth:`~.tracer.StorageTracer.mark_host`);
    - ``Tensor.to(device)`` of a host tensor is a host-to-device copy on CUDA (a new device tensor,
      ``NoGatherHandle``: ``param.ds_tensor.data.to(device=current_device_name())``), where on the CPU
      accelerator it returns the tensor itself: the copy is made (``clone``); a ``to(dtype)`` of a host
      tensor without a device stays on the host.
    """
    import torch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    pin = CPU_Accelerator.pin_memory

    def pin_memory(self, tensor, *a, **k):
        out = pin(self, tensor, *a, **k)
        tracer.mark_host(out)
        return out

    class HostToDevice(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func is torch.Tensor.to and isinstance(args[0], torch.Tensor) and tracer.is_host(args[0]):
                to_device = kwargs.get("device") is not None or any(
                    isinstance(a, (str, torch.device)) for a in args[1:])
                same = out.untyped_storage()._cdata == args[0].untyped_storage()._cdata
                if to_device and same:
                    out = out.clone()
                elif not to_device and not same:
                    tracer.mark_host(out)
            return out

    CPU_Accelerator.pin_memory = pin_memory
    try:
        with HostToDevice():
            yield
    finally:
        CPU_Accelerator.pin_memory = pin


@contextlib.contextmanager
def _replica_sees_meta() -> Iterator[None]:
    """Fake tensors on ``cpu`` report ``meta`` to the replica's own modules (:data:`REPLICA_MODULES`),
    whose ``x.device.type`` checks then choose CUDA's kernels (fused attention, fused RMSNorm)
    as on a meta trace; DeepSpeed, PyTorch and the tracer still see ``cpu``. Tensors are not
    moved: only the branch the replica takes changes."""
    from torch._subclasses.fake_tensor import FakeTensor

    prop = FakeTensor.__dict__["device"]
    meta = __import__("torch").device("meta")

    def device(self):
        if self.fake_mode.in_kernel_invocation or sys._getframe(1).f_globals.get("__name__") in REPLICA_MODULES:
            return meta
        return self.fake_device

    FakeTensor.device = property(device)
    try:
        with _MetaToCpu():
            yield
    finally:
        FakeTensor.device = prop


def _meta_to_cpu(v):
    import torch

    if (isinstance(v, torch.device) and v.type == "meta") or (isinstance(v, str) and v == "meta"):
        return torch.device("cpu")
    return v


class _MetaToCpu(__import__("torch").overrides.TorchFunctionMode):
    """The other half of :func:`_replica_sees_meta`: a tensor the replica makes "on the device of
    ``x``" (``device=x.device``, ``.to(x.device)``) is made on ``cpu``, where ``x`` really is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if sys._getframe(1).f_globals.get("__name__") not in REPLICA_MODULES:  # DeepSpeed's own meta tensors stay
            return func(*args, **kwargs)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_meta_to_cpu(kwargs["device"]))
        args = tuple(_meta_to_cpu(a) if not hasattr(a, "shape") else a for a in args)
        return func(*args, **kwargs)


def _trace(exp: ExperimentSpec, scale_layers: Optional[int], rank: int, debug: bool,
           say: Callable[[str], None]) -> Measurement:
    """Run the two steps in this process (see the module docstring); call once per process."""
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .model import build_model, param_count
    from .step import Probe, Step, fill_measurement, train_step, two_steps
    from .tracer import StorageTracer

    tr = exp.training
    meas = Measurement(device="cpu (fake, DeepSpeed)")
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    n = tr.gpus
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_SIZE="1", DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed import comm as ds_comm

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    ds_comm.init_distributed(dist_backend="fake", auto_mpi_discovery=False, dist_init_required=False)
    torch.manual_seed(0)
    tracer = StorageTracer("cpu", exp.profile.allocator_round_bytes, debug=debug)
    probe = Probe("cpu", tracer)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with _patches(), _host_memory(tracer), _replica_sees_meta(), fake, tracer:
        say(f"building {m.name} ({m.n_layers} layers), DeepSpeed ZeRO-{tr.zero}, rank {rank} of {n}")
        model = build_model(m, tr, exp.profile, device="cpu")
        model.cfg.preserve_rng = False  # as on meta: CUDA keeps the RNG state on the host
        meas.params = param_count(model)[0]
        impl = tr.optimizer_impl
        opt_cls = torch.optim.AdamW if tr.optimizer == "adamw" else torch.optim.Adam
        opt = opt_cls([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                      foreach=impl == "foreach", fused=impl == "fused" or None)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(exp),
                                               dist_init_required=False)
        model.on_label = probe.label
        ids = torch.zeros((tr.batch, tr.seq), dtype=torch.int64)
        labels = torch.zeros((tr.batch, tr.seq), dtype=torch.int64)

        # DeepSpeed's loop: the engine scales the loss and runs backward; engine.step() after every
        # micro-step steps only at the accumulation boundary (the last micro-step)
        parts = Step(forward=lambda: engine(ids, labels), grad_accum=tr.grad_accum, optimizer_step=engine.step,
                     backward=engine.backward, scale=False, step_each_micro=True, release_loss=True)
        meas.first_step_bytes, result = two_steps(probe, lambda: train_step(parts, probe.set_phase), say)
        fill_measurement(meas, result, probe, "cpu", None, tracer, debug)
        if tr.deepspeed is not None and tr.deepspeed.offload_param:
            meas.host_param_bytes = tracer.host_current  # the pinned buffers held through the step
    return meas


def trace_deepspeed(exp: ExperimentSpec, scale_layers: Optional[int] = None, rank: int = 0, debug: bool = False,
                    progress: Optional[Callable[[str], None]] = None, timeout_s: float = 600) -> Measurement:
    """Trace rank ``rank`` of a DeepSpeed ZeRO-2/3 step of ``exp`` in a fresh subprocess (see the
    module docstring); a setup it cannot run is returned ``skipped`` with the reason."""
    t0 = time.perf_counter()
    why = deepspeed_unsupported(exp)
    if why:
        return Measurement(device="cpu (fake, DeepSpeed)", status="skipped", reason=why)
    if not 0 <= rank < exp.training.gpus:
        return Measurement(device="cpu (fake, DeepSpeed)", status="error",
                           reason=f"rank {rank} is not one of the {exp.training.gpus} ranks (0-{exp.training.gpus - 1})")
    job = {"exp": exp.model_dump(mode="json"), "scale_layers": scale_layers, "rank": rank, "debug": debug}
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    try:
        out = subprocess.run([sys.executable, "-m", "memcalc.validate.deepspeed_trace"], input=json.dumps(job),
                             capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return Measurement(device="cpu (fake, DeepSpeed)", status="error", reason=f"the trace ran past {timeout_s:.0f} s")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return Measurement(device="cpu (fake, DeepSpeed)", status="error", reason=f"the trace process failed: {tail}")
    rec = json.loads(lines[-1])
    say = progress or (lambda _m: None)
    for msg in rec.pop("_progress", []):
        say(msg)
    meas = Measurement(**{k: v for k, v in rec.items() if k in Measurement.__dataclass_fields__})
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas


def _main() -> None:
    job = json.loads(sys.stdin.read())
    exp = ExperimentSpec.model_validate(job["exp"])
    said: list[str] = []
    t0 = time.perf_counter()
    try:
        meas = _trace(exp, job["scale_layers"], job["rank"], job["debug"], said.append)
    except Exception as e:  # noqa: BLE001 - the record says why; the parent shows it
        meas = Measurement(device="cpu (fake, DeepSpeed)", status="error", reason=error_reason(e))
    meas.seconds = round(time.perf_counter() - t0, 3)
    rec = meas.to_dict()
    rec["peak_live"] = [list(x) for x in rec.get("peak_live", [])][:40]
    rec["_progress"] = said
    sys.stdout.write("\n" + json.dumps(rec) + "\n")
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's and the fake group's process-wide state need no teardown


if __name__ == "__main__":
    _main()
