"""IR -> CUDA C++ (CuTe/CUTLASS tiles + NVSHMEM), compiled by NVRTC.

Not written yet: the simulator (``tldsl.runtime.sim``) consumes the same IR meanwhile.
"""
