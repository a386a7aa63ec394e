"""``python -m tldsl``: one entry point for what the package runs — the demo, the benchmarks,
the torchrun checks, the mutation check, the compiled-kernel cache, and ``doctor``, a report of
what is installed. :mod:`.main` parses and dispatches; :mod:`.gates` refuses, in one line, what
cannot run on this machine (the benchmark module itself uses them too, so this package imports
nothing at import time); :mod:`.cache` and :mod:`.doctor` are the two commands of its own."""
