"""``python -m tldsl.bench`` (and ``torchrun ... -m tldsl.bench``): :func:`tldsl.bench.cli.main`,
what it is given and tldsl refuses (a schedule, a shape) answered in one line as ``python -m tldsl
bench`` answers it (:func:`tldsl.cli.main.answered`)."""
import os

from ..cli.main import answered
from .cli import main

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(answered("python -m tldsl.bench", main))
