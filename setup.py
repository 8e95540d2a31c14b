"""Plain setuptools build; the package is pure Python. Each csrc/*.cu (the CUDA kernels and sgDMA) is compiled by nvcc
at its first use where a CUDA GPU and nvcc exist (nanovllm/kernels/cuda_library.py) and loaded with ctypes, not
here: a build takes seconds and needs no torch headers."""
from setuptools import setup

setup()
