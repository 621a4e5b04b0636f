"""The ``memcalc`` command: the console script's entry point, and ``python -m memcalc``."""

from __future__ import annotations


def main() -> None:
    from memcalc.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
