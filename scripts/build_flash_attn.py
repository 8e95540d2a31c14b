"""Build flash-attn 2.8.3's forward kernels for sm_90 where no binary wheel fits (the device: torch 2.11 + CUDA 13),
so that the flash_attn backend runs there. Only what attention/flash_attn_backend.py calls is compiled: head dims 64
and 128, fp16/bf16, causal or not, with and without split-KV (16 kernel files); every other head dim and the
backward pass are stubs that raise. About 8 minutes on the device's 16 cores.

    pip download --no-deps --no-binary :all: flash-attn==2.8.3   # here: the sdist (8.4 MB) into an ignored folder
    python scripts/build_flash_attn.py flash_attn-2.8.3.tar.gz SITE  # there: SITE/flash_attn_2_cuda.so + flash_attn/
    PYTHONPATH=SITE python bench.py --attention-backend flash_attn

Its sdist's metadata step imports torch, so `pip download` may stop there; the tarball is then on PyPI's simple
index (files.pythonhosted.org). The shared object is ~69 MB (7.9 MB xz-compressed, which is how it can be carried
to a later device call)."""
import os
import shutil
import sys
import tarfile
import time

from torch.utils.cpp_extension import load

HEAD_DIMS = (64, 128)
ALL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)  # what flash_api.cpp dispatches to
TYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
              "--expt-extended-lambda", "--use_fast_math", "-gencode", "arch=compute_90,code=sm_90",
              "-DFLASHATTENTION_DISABLE_BACKWARD"]


def kernel_sources(src: str) -> list[str]:
    return [f"{src}/csrc/flash_attn/src/flash_fwd_{'split_' if split else ''}hdim{d}_{t}{'_causal' if causal else ''}"
            f"_sm80.cu" for d in HEAD_DIMS for t in TYPES for causal in (False, True) for split in (False, True)]


def stubs() -> str:
    """Definitions for the kernels not built, so that the module links; each raises if called."""
    lines = ["#include <cutlass/numeric_types.h>", '#include "namespace_config.h"', '#include "flash.h"',
             "#include <c10/util/Exception.h>", "namespace FLASH_NAMESPACE {"]
    for d in ALL_HEAD_DIMS:
        names = ["run_mha_bwd_"] + ([] if d in HEAD_DIMS else ["run_mha_fwd_", "run_mha_fwd_splitkv_dispatch"])
        for name in names:
            params = "Flash_bwd_params" if "bwd" in name else "Flash_fwd_params"
            for t in TYPES.values():
                for causal in ("false", "true"):
                    lines.append(f"template<> void {name}<{t}, {d}, {causal}>({params} &, cudaStream_t) "
                                 f'{{ TORCH_CHECK(false, "this flash-attn build: forward, head dims {HEAD_DIMS}"); }}')
    return "\n".join(lines + ["}"]) + "\n"


def main(tarball: str, site: str, work: str = "/tmp/flash_attn_build"):
    src = f"{work}/flash_attn-2.8.3"
    if not os.path.isdir(src):
        with tarfile.open(tarball) as t:
            t.extractall(work)
    with open(f"{work}/stubs.cu", "w") as f:
        f.write(stubs())
    fa = f"{src}/csrc/flash_attn"
    os.makedirs(f"{work}/build", exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count()))
    start = time.time()
    load("flash_attn_2_cuda", [f"{fa}/flash_api.cpp", *kernel_sources(src), f"{work}/stubs.cu"],
         extra_cflags=["-O3", "-std=c++17", "-DFLASHATTENTION_DISABLE_BACKWARD"], extra_cuda_cflags=NVCC_FLAGS,
         extra_include_paths=[fa, f"{fa}/src", f"{src}/csrc/cutlass/include"], build_directory=f"{work}/build")
    os.makedirs(site, exist_ok=True)
    shutil.copy(f"{work}/build/flash_attn_2_cuda.so", site)
    shutil.rmtree(f"{site}/flash_attn", ignore_errors=True)
    os.makedirs(f"{site}/flash_attn")
    for name in ("__init__.py", "flash_attn_interface.py"):  # all that `import flash_attn` needs
        shutil.copy(f"{src}/flash_attn/{name}", f"{site}/flash_attn")
    print(f"built in {time.time() - start:.0f} s: {site}/flash_attn_2_cuda.so "
          f"({os.path.getsize(f'{site}/flash_attn_2_cuda.so') / 1e6:.0f} MB)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
