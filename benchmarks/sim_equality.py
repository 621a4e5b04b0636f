"""Check that two versions of the simulator give the same results, byte for byte (not a test: it
runs a few dozen full-depth steps, which takes a minute; pytest does not collect this folder).

For ~40 diverse setups (the plan's techniques, a MoE and an MLA preset, ZeRO, FSDP2/FSDP1,
DeepSpeed, tensor parallelism, compile, activation offloading, DoRA, profiles) it writes a digest
of everything a step produces: ``estimate()``'s JSON, and ``simulate()``'s peak, phase peaks,
peak breakdown (categories and kinds), alloc trace, allocator events and timeline, at full depth
and at 3 layers. Run it with one version's interpreter and code, then with the other's, and
compare::

    cd /tmp && PYTHONPATH=/path/to/old/checkout /work/main/.venv/bin/python \\
        /path/to/benchmarks/sim_equality.py --dump /tmp/old.json
    .venv/bin/python benchmarks/sim_equality.py --dump /tmp/new.json --against /tmp/old.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

SETUPS: list[dict[str, Any]] = [
    dict(model="llama-3.1-8b", bf16=True, seq=512),
    dict(model="llama-3.1-8b", bf16=True, seq=512, checkpoint="full", fused_optimizer=True),
    dict(model="llama-3.1-8b", qlora=True, checkpoint="sqrt", seq=512, batch=2),
    dict(model="llama-3.1-8b", lora=True, bf16=True, checkpoint="selective", seq=1024),
    dict(model="llama-3.1-8b", precision="amp-bf16", optimizer="adamw-8bit", seq=256),
    dict(model="llama-3.1-8b", precision="fp32", optimizer="adafactor", checkpoint="full", seq=256),
    dict(model="llama-3.1-8b", bf16=True, master_weights=True, seq=256, grad_accum=3),
    dict(model="llama-3.1-8b", bf16=True, compile=True, seq=512),
    dict(model="llama-3.1-8b", bf16=True, compile=True, memory_budget=0.3, seq=512),
    dict(model="llama-3.1-8b", lora=True, compile=True, checkpoint="full", seq=512),
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=8, seq=512, checkpoint="full"),
    dict(model="llama-3.1-8b", bf16=True, zero=2, gpus=4, seq=512),
    dict(model="llama-3.1-8b", bf16=True, zero=1, gpus=4, seq=512, offload_optimizer=True),
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=8, sharding="fsdp2", seq=512),
    dict(model="llama-3.1-8b", precision="amp-bf16", zero=3, gpus=4, sharding="fsdp2", seq=512, checkpoint="full"),
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=4, sharding="fsdp1", seq=512),
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=8, sharding="deepspeed", seq=512),
    dict(model="llama-3.1-8b", bf16=True, zero=2, gpus=8, sharding="deepspeed", seq=512),
    dict(model="llama-3.1-8b", bf16=True, tp=4, seq=512),
    dict(model="llama-3.1-8b", bf16=True, tp=2, sequence_parallel=True, zero=3, gpus=4, sharding="fsdp2", seq=512),
    dict(model="llama-3.1-8b", bf16=True, activation_offload=True, seq=512),
    dict(model="llama-3.1-8b", lora=True, dora=True, bf16=True, seq=512),
    dict(model="llama-3.1-8b", lora=True, bf16=True, framework="hf", seq=512),
    dict(model="llama-3.1-8b", bf16=True, framework="torchtune", loss="chunked", seq=512),
    dict(model="llama-3.1-8b", bf16=True, checkpoint="selective-op", seq=512),
    dict(model="llama-3.1-8b", bf16=True, checkpoint="every-4", seq=512),
    dict(model="llama-3.1-8b", bf16=True, torch="2.4", seq=512),
    dict(model="qwen3-30b-a3b", bf16=True, seq=256, checkpoint="full"),
    dict(model="qwen3-30b-a3b", lora=True, bf16=True, seq=256),
    dict(model="deepseek-v3", bf16=True, seq=128, checkpoint="full", zero=3, gpus=64, sharding="fsdp2"),
    dict(model="gpt2", precision="amp-fp16", batch=4, seq=512, checkpoint="selective"),
    dict(model="gpt2", batch=2, seq=512, compile=True, memory_budget=0.5),
    dict(model="phi-1.5", lora=True, lora_targets="all", lora_dropout=0.05, precision="bf16", optimizer="lion",
         seq=512),
    dict(model="gemma-2-9b", bf16=True, seq=512, framework="hf"),
    dict(model="gpt-oss-20b", bf16=True, seq=256),
    dict(model="tinyllama-1.1b", optimizer="sgd-momentum", grad_accum=4, checkpoint="every-2",
         optimizer_impl="for-loop"),
    dict(model="gpt2-xl", fused_optimizer=True, checkpoint="sqrt", optimizer="adafactor", seq=512),
    dict(model="mixtral-8x7b", qlora=True, seq=256, checkpoint="full"),
    dict(model="qwen2.5-7b", bf16=True, optimizer_impl="fused", seq=512, profile="hf-torch-2.8-cuda"),
    dict(config="control"),
    dict(config="memory_budget_05"),
    # checkpointing across the rest (memcalc.engine.checkpoint counts the early stop in the first
    # forward): autocast copies of frozen weights, layer hooks inside sqrt segments, offloading
    dict(model="llama-3.1-8b", lora=True, precision="amp-bf16", checkpoint="full", seq=512),
    dict(model="llama-3.1-8b", qlora=True, precision="amp-bf16", checkpoint="sqrt", seq=256),
    dict(model="llama-3.1-8b", bf16=True, activation_offload=True, checkpoint="full", seq=512),
    dict(model="llama-3.1-8b", lora=True, activation_offload=True, checkpoint="full", seq=256),
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=4, sharding="fsdp2", seq=512, checkpoint="sqrt"),
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=4, sharding="fsdp1", seq=512, checkpoint="sqrt"),
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=8, sharding="deepspeed", seq=512, checkpoint="sqrt"),
    dict(model="llama-3.1-8b", bf16=True, tp=2, checkpoint="full", seq=512),
    dict(model="llama-3.1-8b", lora=True, dora=True, precision="amp-bf16", checkpoint="full", seq=256),
    dict(model="llama-3.1-8b", precision="amp-bf16", checkpoint="selective-op", seq=512),
    dict(model="llama-3.1-8b", lora=True, compile=True, checkpoint="sqrt", seq=512),
    dict(model="deep-one-1.6b", checkpoint="full", seq=512),
    dict(model="phi-1.5", lora=True, precision="bf16", checkpoint="sqrt", seq=512),
    dict(model="phi-4", bf16=True, checkpoint="full", seq=256),
    dict(model="gemma-2-9b", bf16=True, seq=512, framework="hf", checkpoint="sqrt"),
    dict(model="gpt-oss-20b", bf16=True, seq=256, checkpoint="full"),
    dict(model="qwen3-30b-a3b", lora=True, bf16=True, seq=256, checkpoint="sqrt"),
    dict(model="deepseek-v3", bf16=True, seq=128, checkpoint="selective", zero=3, gpus=64, sharding="fsdp2"),
]


def _h(x: Any) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _sim_digest(r: Any) -> dict[str, Any]:
    return {
        "peak": [r.peak_bytes, r.peak_phase, r.peak_label],
        "categories": sorted(r.peak_categories.items()),
        "kinds": sorted(r.peak_kinds.items()),
        "phases": list(r.phases.items()),
        "max_act": r.max_activation_bytes,
        "trace": _h(r.alloc_trace),
        "events": _h(r.events),
        "step_start": r.step_start,
        "timeline": _h([(p.index, p.label, p.phase, sorted(p.by_kind.items())) for p in r.timeline]),
        "host": r.host_offload,
        "paged": r.paged_state_bytes,
    }


def digest(kw: dict[str, Any]) -> dict[str, Any]:
    from memcalc.api import _resolve
    from memcalc.estimate.peak import estimate
    from memcalc.estimate.step import simulate
    from memcalc.plan.depth import shallow
    from memcalc.render.report import to_json

    res = _resolve(None, dict(kw))
    exp = res.exp
    out: dict[str, Any] = {"estimate": _h(to_json(estimate(exp), res, []))}
    for name, e in (("full", exp), ("depth3", shallow(exp, 3))):
        for first in (False, True):
            r = simulate(e, first_step=first, record_timeline=not first, trace_allocs=True, events=True)
            out[f"{name}/{'first' if first else 'steady'}"] = _sim_digest(r)
            lean = simulate(e, first_step=first, record_timeline=False, trace_allocs=True)
            out[f"{name}/{'first' if first else 'steady'}/lean"] = [lean.peak_bytes, _h(lean.alloc_trace),
                                                                    list(lean.phases.items())]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--against")
    a = ap.parse_args()
    res = {}
    for kw in SETUPS:
        key = json.dumps(kw, sort_keys=True)
        try:
            res[key] = digest(kw)
        except Exception as e:  # a setup this version refuses: the refusal itself is compared
            res[key] = {"error": f"{type(e).__name__}: {e}"}
        print(key, res[key].get("error", "ok"), file=sys.stderr)
    with open(a.dump, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    if a.against:
        with open(a.against) as f:
            old = json.load(f)
        res = json.loads(json.dumps(res, sort_keys=True))
        bad = [k for k in old if old[k] != res.get(k)]
        for k in bad:
            print("DIFFERS:", k, file=sys.stderr)
        print(f"{len(old) - len(bad)}/{len(old)} setups identical")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
