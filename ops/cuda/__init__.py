"""The GPU path: the executor and its lanes, nvImageCodec decode through the C shim (``_native/``),
the planning of a batch on the host, and the CuPy kernels that resample, normalise and apply the
post ops on the GPU. It imports from ``ops/cpu`` nothing; Pillow (``ops/_pillow.py``) is its
declared fallback for images nvImageCodec should not decode."""
