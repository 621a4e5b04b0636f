"""memcalc: predict the peak GPU memory of a training step from its timeline.

The package never imports torch; the torch-backed validator lives in
``memcalc.validate`` (installed from the repository's ``validate/`` folder).
"""

__version__ = "0.1.0"
