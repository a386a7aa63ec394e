"""The op library, written in the tile language (each module: the kernel and a numpy reference)."""
