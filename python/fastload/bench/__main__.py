"""``python -m fastload.bench``; see :mod:`fastload.bench`."""

if __name__ == "__main__":  # spawned workers may import this module: do nothing then
    import sys

    from fastload.bench.cli import main

    sys.exit(main())
