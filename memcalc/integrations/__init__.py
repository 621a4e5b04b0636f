"""Plug memcalc into training frameworks, to compare its estimate with a real run.

- :mod:`memcalc.integrations.transformers`: ``MemcalcCallback`` for the Hugging Face ``Trainer``.

Importing these modules never imports torch; the callback itself is built (with torch and
transformers) in ``memcalc.validate.callback`` when it is first used.
"""
