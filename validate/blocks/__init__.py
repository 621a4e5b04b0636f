"""The replica's blocks: the PyTorch twin of each estimator block (:mod:`memcalc.engine.blocks`), one
module per block under the same name: ``adapters`` (Linear with LoRA / DoRA / QLoRA), ``norm``,
``attention`` (the module) + ``attention_variants``, ``mla``, ``mlp``, ``moe``, ``layer`` (the
decoder layer), ``head`` (the output head and the loss); ``sdpa`` holds the attention kernels
(SDPA's, RoPE, ALiBi), ``build`` what the blocks are built with (:class:`~.build.BuildConfig`),
``base`` the dropout they share. ``validate/model.py`` composes them into the decoder."""
