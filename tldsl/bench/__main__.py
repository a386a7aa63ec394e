"""``python -m tldsl.bench`` (and ``torchrun ... -m tldsl.bench``): :func:`tldsl.bench.cli.main`."""
import os

from .cli import main

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
