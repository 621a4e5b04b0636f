"""memcalc.measure() and MemcalcCallback on real (tiny) runs: the estimate of the same setup beside
the measurement, written as a `memcalc validate` record. On CPU nothing is measured (measured_bytes
null); the CUDA bookkeeping is checked with torch.cuda's counters faked, and for real where CUDA is."""

from __future__ import annotations

import json
import os
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import memcalc  # noqa: E402
from memcalc.validate.hf_presets import patch_peft_old_torchao  # noqa: E402

patch_peft_old_torchao()  # PEFT 0.21 raises on torchao 0.14 (torchtune's pin): see validate/hf_presets.py

pytestmark = pytest.mark.slow

#: keys of a `memcalc validate` record (source: validate/record.py make_record)
VALIDATE_KEYS = {"config", "device", "predicted_bytes", "measured_bytes", "published_bytes", "error_pct",
                 "published_error_pct", "peak_phase", "measured_phase", "first_step_bytes", "reserved_bytes",
                 "status", "reason", "torch_version", "framework", "transformers_version", "peft_version", "seconds",
                 "run_id"}
#: what measure() and the callback add
EXTRA_KEYS = {"source", "gpu_name", "cuda_version", "steps", "step_peak_bytes", "step_reserved_bytes", "notes"}
CUDA = torch.cuda.is_available()
BATCH, SEQ, VOCAB = 2, 32, 128


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        x = torch.randint(0, VOCAB, (SEQ,))
        return {"input_ids": x, "labels": x.clone()}


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def train_with_callback(tmp_path, use_cpu: bool, **cb):
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from memcalc.integrations.transformers import MemcalcCallback

    model = peft.get_peft_model(LlamaForCausalLM(tiny_config()),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    out = tmp_path / "run.json"
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=2, report_to=[],
                             use_cpu=use_cpu, logging_strategy="no", save_strategy="no", activation_checkpointing=True,
                             disable_tqdm=True)
    callback = MemcalcCallback(output=str(out), **cb)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback]).train()
    return callback, json.loads(out.read_text())


def same_setup_by_hand(**kw):
    """The callback's setup written as memcalc.estimate keywords (source: the run above: fp32 weights,
    no bf16/fp16 flag, activation checkpointing, the default optim adamw_torch, LoRA r 4 alpha 8 on q,v)."""
    cfg = json.loads(tiny_config().to_json_string(use_diff=True))
    return memcalc.estimate(model=cfg, batch=BATCH, seq=SEQ, precision="fp32", checkpoint="full", optimizer="adamw",
                            optimizer_impl="foreach", lora=True, lora_rank=4, lora_alpha=8, lora_targets="q_proj,v_proj",
                            lora_dropout=0.0, **kw)


def test_callback_on_cpu_writes_the_estimate_and_no_measurement(tmp_path, no_cuda, capsys):
    cb, records = train_with_callback(tmp_path, use_cpu=True)
    [rec] = records
    assert VALIDATE_KEYS | EXTRA_KEYS <= set(rec)
    assert rec["measured_bytes"] is None and rec["status"] == "skipped" and rec["error_pct"] is None
    assert rec["predicted_bytes"] == same_setup_by_hand().peak_bytes
    assert rec["source"] == "callback" and rec["framework"] == "hf" and rec["device"] == "cuda"
    assert rec["transformers_version"] == transformers.__version__ and rec["peft_version"] == peft.__version__
    assert rec["steps"] == 0 and rec["step_peak_bytes"] == []
    err = capsys.readouterr().err
    assert err.count("memcalc: warning: CUDA is not available: nothing was measured") == 1
    assert "keys memcalc does not read" not in err  # the live config reads as its config.json would
    o = cb.options  # what was read from the run
    assert (o["batch"], o["grad_accum"], o["precision"], o["checkpoint"]) == (BATCH, 1, "fp32", "full")
    assert (o["lora_rank"], o["lora_alpha"], o["lora_targets"]) == (4, 8.0, "q,v")  # the --recipe reader's names
    assert (cb.seen_batch, cb.seen_seq) == (BATCH, SEQ)  # the shape the model was given


def test_callback_keywords_override_what_is_read(tmp_path):
    from transformers import LlamaForCausalLM, TrainingArguments

    from memcalc.integrations.transformers import MemcalcCallback

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, bf16=True, report_to=[],
                             use_cpu=True, gradient_accumulation_steps=3)
    model = LlamaForCausalLM(tiny_config()).to(torch.bfloat16)
    opts, notes = MemcalcCallback(framework="torchtune", seq=64).setup(args, model)
    assert (opts["batch"], opts["grad_accum"], opts["precision"], opts["seq"]) == (4, 3, "bf16", 64)
    assert opts["framework"] == "torchtune" and "lora" not in opts and "checkpoint" not in opts


def test_measure_around_a_plain_loop_on_cpu(tmp_path, no_cuda, capsys):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config())
    opt = torch.optim.AdamW(model.parameters())
    out = tmp_path / "loop.json"
    kw = dict(model=json.loads(tiny_config().to_json_string(use_diff=True)), batch=BATCH, seq=SEQ, precision="fp32")
    with memcalc.measure(output=str(out), **kw) as m:
        for _ in range(2):
            x = torch.randint(0, VOCAB, (BATCH, SEQ))
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            m.step()
    [rec] = json.loads(out.read_text())
    assert rec == {**m.record, "run_id": rec["run_id"]}
    assert rec["predicted_bytes"] == memcalc.estimate(**kw).peak_bytes
    assert rec["measured_bytes"] is None and rec["source"] == "measure"
    assert capsys.readouterr().err.count("nothing was measured") == 2  # the warning, and the summary line


def test_measure_refuses_bad_input_before_the_loop(tmp_path):
    with pytest.raises(memcalc.UserError, match="unknown model preset 'llama-9'"):
        memcalc.measure(model="llama-9")
    with pytest.raises(memcalc.UserError, match="does not exist"):
        memcalc.measure(model="gpt2", output=str(tmp_path / "no" / "such" / "run.json"))
    # source: memcalc.core.files.check_output_path, as --output (issue 32 fuzz: as root, output="/dev/full" swapped
    # the device node for a regular file; a FIFO and an unrelated text file were replaced too)
    fifo, notes = tmp_path / "pipe", tmp_path / "notes.txt"
    os.mkfifo(fifo)
    notes.write_text("my notes\n")
    for path, message in (("/dev/full", "/dev/full is a kernel interface, not a file"),
                          (str(fifo), "it is a FIFO (named pipe), not a regular file"),
                          (str(notes), "exists and is not a JSON list of validate records; give another path, or "
                                       "remove it")):
        with pytest.raises(memcalc.UserError, match=re.escape(message)):
            memcalc.measure(model="gpt2", output=path)


class FakeCuda:
    """torch.cuda's memory counters, scripted: each reset starts the next step's peak."""

    def __init__(self, peaks, reserved):
        self.peaks, self.reserved, self.i = list(peaks), list(reserved), 0

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peaks[self.i])
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: self.reserved[self.i])
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: setattr(self, "i", min(self.i + 1, len(self.peaks) - 1)))


def test_measured_fields_and_gap_with_faked_cuda_counters(tmp_path, monkeypatch):
    # (the CUDA bookkeeping without a GPU: the counters are scripted, the record is computed)
    kw = dict(model="gpt2", batch=1, seq=128)
    pred = memcalc.estimate(**kw).peak_bytes
    peaks = [0, pred + 100 * 2**20, pred - 2**20, pred]  # index 0: the reset by start()
    fake = FakeCuda(peaks, [p + 2**30 for p in peaks])
    fake.install(monkeypatch)
    with memcalc.measure(output=str(tmp_path / "r.json"), quiet=True, **kw) as m:
        for _ in range(3):
            m.step()
    rec = m.record
    assert rec["step_peak_bytes"] == peaks[1:] and rec["steps"] == 3
    assert rec["measured_bytes"] == max(peaks) and rec["first_step_bytes"] == peaks[1]
    assert rec["reserved_bytes"] == max(peaks) + 2**30
    assert rec["error_pct"] == round((pred - max(peaks)) / max(peaks) * 100, 3)
    assert rec["status"] == "ok" and rec["gpu_name"] == "Fake GPU"


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_measure_on_cuda_fills_the_measurement(tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config()).cuda()
    opt = torch.optim.AdamW(model.parameters())
    kw = dict(model=json.loads(tiny_config().to_json_string(use_diff=True)), batch=BATCH, seq=SEQ, precision="fp32")
    with memcalc.measure(output=str(tmp_path / "r.json"), **kw) as m:
        for _ in range(3):
            x = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            m.step()
    rec = m.record
    assert rec["status"] == "ok" and rec["measured_bytes"] == max(rec["step_peak_bytes"]) > 0
    assert rec["error_pct"] == round((rec["predicted_bytes"] - rec["measured_bytes"]) / rec["measured_bytes"] * 100, 3)
    assert rec["gpu_name"] == torch.cuda.get_device_name() and rec["cuda_version"] == torch.version.cuda


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_callback_on_cuda_fills_the_measurement(tmp_path):
    cb, [rec] = train_with_callback(tmp_path, use_cpu=False)
    assert rec["status"] == "ok" and rec["steps"] == 2 and len(rec["step_peak_bytes"]) == 2
    assert rec["measured_bytes"] == max(rec["step_peak_bytes"]) and rec["error_pct"] is not None
    assert rec["predicted_bytes"] == same_setup_by_hand().peak_bytes


def test_a_transformers_config_object_is_a_model():
    # source: PretrainedConfig.to_json_string(use_diff=True), what save_pretrained writes as config.json
    cfg = tiny_config()
    by_object = memcalc.estimate(model=cfg, batch=BATCH, seq=SEQ, lora=True)
    by_dict = memcalc.estimate(model=json.loads(cfg.to_json_string(use_diff=True)), batch=BATCH, seq=SEQ, lora=True)
    assert by_object.peak_bytes == by_dict.peak_bytes and by_object.spec.model.n_layers == 2
