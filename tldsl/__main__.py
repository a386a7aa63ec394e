"""``python -m tldsl`` (and ``torchrun ... -m tldsl``): :func:`tldsl.cli.main.main`."""
from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
