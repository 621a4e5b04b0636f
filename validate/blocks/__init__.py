"""The replica's blocks: the PyTorch twin of each estimator block (:mod:`memcalc.engine.blocks`), one
module per block under the same name (``adapters``, ``attention`` + ``attention_variants``,
``mla``, ``mlp``, ``moe``, ``norm``, ``head``; ``base`` the dropout they share); ``validate/model.py``
composes them into the decoder (its attention, layer and head modules)."""
