"""``python -m tldsl`` (and ``torchrun ... -m tldsl``): :func:`tldsl.cli.main`."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
