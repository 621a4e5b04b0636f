"""``python -m memcalc.cli``: the ``memcalc`` command."""

from memcalc.cli import main

main()
