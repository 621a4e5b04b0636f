"""Stage 1, inputs: flags, reference configs, model presets, Hugging Face configs, ``--params``
inference, kernel profiles and the GPU catalog, each resolved into the specs of
:mod:`memcalc.core.spec`. Nothing downstream reads a file."""
