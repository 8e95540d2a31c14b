"""Plain setuptools build; the package is pure Python. csrc/gemv_one_row.cu is compiled by nvcc at its first use
on a Hopper GPU (nanovllm/kernels/gemv_one_row.py), not here; the KV-offload extension (strided 2-D DMA) is to be
added to `ext_modules` where CUDA torch and nvcc exist."""
from setuptools import setup


def ext_modules():
    return []  # csrc/ arrives with the KV-offload issue


setup(ext_modules=ext_modules())
