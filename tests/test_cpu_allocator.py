"""The CPU engine's malloc tuning: freed activations are reused instead of faulting in fresh pages."""
import resource
import sys

import pytest
import torch

from nanovllm.engine.cpu_allocator import keep_freed_memory


def _minor_faults_of(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_large_activations_reuse_warm_pages():
    assert keep_freed_memory()
    pages = (32 << 20) // 4096

    def steps():
        for _ in range(20):  # a step's worth of 32 MiB activations, allocated, written and freed
            torch.empty(8 << 20).fill_(1.0)

    steps()  # the first allocation may fault its pages in once
    faults = _minor_faults_of(steps)
    assert faults < 2 * pages, f"{faults} page faults for 20 reused 32 MiB buffers ({pages} pages each)"
