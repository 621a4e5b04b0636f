"""Stage 4, planning (``memcalc plan``): which GPU, how many, and with which memory techniques.

Three questions, all answered from the simulated step (:mod:`memcalc.engine.timeline`):

1. ``plan --model M --gpu G`` (:func:`memcalc.plan.search.plan_gpu`): every technique
   combination (:mod:`memcalc.plan.options`) that fits one G, with its largest batch and
   sequence, ranked by a relative step-time cost per token (:mod:`memcalc.plan.cost`).
2. ``plan --model M`` (:func:`memcalc.plan.cluster.plan_cluster`): for every GPU in the catalog,
   the fewest GPUs for a full fine-tune and for a LoRA run (ZeRO-3 over N GPUs).
3. ``estimate --max-batch / --max-seq`` (:mod:`memcalc.plan.limits`): the inverse questions for
   one setup, by binary search over direct estimates.

The searches ask "fits" of :func:`memcalc.estimate.peak.required_bytes` on the card's own GPU side (the
device total of :mod:`memcalc.core.gpu_side` with reserved taken as allocated: no allocator replay per
probe, a lower bound of the estimate's); ``plan --gpu``'s rows (their "needs" and whether they are
listed as fitting) and ``estimate --max-batch/--max-seq`` take the estimate's own verdict, its allocator
replay included (:func:`memcalc.plan.simulations.device_total`: what each row's command prints). The
searches use closed-form fits of the step (:mod:`memcalc.plan.fits`) over cached simulations
(:mod:`memcalc.plan.simulations`), run in worker processes (:mod:`memcalc.plan.parallel`), and confirm
every printed number with direct estimates. A deep stack's simulation runs on copies of the model with
3, 4 and 5 periods of its layout (:mod:`memcalc.core.layout`: 3, 4 and 5 layers for a uniform stack) and
is extrapolated exactly to the real depth (:mod:`memcalc.plan.depth`; checked, else simulated directly),
so those confirmations cost about 12 periods instead of the model's depth.
Rendering lives in :mod:`memcalc.render.plan_report`.
"""
