"""Plain setuptools build. The csrc/ CUDA extension (strided 2-D DMA for KV offload) is added to
`ext_modules` here where CUDA torch and nvcc exist; on CPU-only machines the package is pure Python."""
from setuptools import setup


def ext_modules():
    return []  # csrc/ arrives with the KV-offload issue


setup(ext_modules=ext_modules())
