"""memcalc.validate: measure the peak memory of a training step, to check the estimate.

Built from the same specs as the estimator (:mod:`memcalc.core.spec`), with torch:

- :mod:`.model` a generic decoder from a ``ModelSpec`` (Forgather's Deep One code path exactly);
- :mod:`.optim` the optimizers (Forgather's Adafactor, Lion, 8-bit AdamW, master weights);
- :mod:`.tracer` counts live storages on ``meta``/``cpu`` rounded like the CUDA caching allocator;
  :mod:`memcalc.core.allocator` optionally replays the allocator itself (whole blocks, segments);
- :mod:`.attention`, :mod:`.layers`, :mod:`.amp` the kernels CUDA runs, named explicitly;
- :mod:`.runner` ``measure(exp, device)``: one warm-up step, then the measured steady-state step;
- :mod:`.command` ``run_validate``: predictions beside measurements, table or JSON; :mod:`.record`
  the record (``make_record``, given the prediction), :mod:`.predict` the prediction (through
  :mod:`memcalc.api`, the validator's only way to the estimator);
- ``--framework hf``: :mod:`.hf_model` (ModelSpec -> transformers config, PEFT targets), :mod:`.hf_kernels`
  (kernel dispatch, autocast, packed-sequence answer), :mod:`.hf_runner` (the HF step),
  :mod:`.hf_grid` (HF setups beside the estimate).

Installed as ``memcalc.validate`` (the folder is ``validate/`` in the repository).
"""
