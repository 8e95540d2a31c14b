"""The one-shot all-reduce (kernels/all_reduce.py, distributed/custom_all_reduce.py) against its reference: on CPU
under the Triton interpreter with a peer whose buffer and flag are written beforehand, and on two GPUs between two
processes, eagerly and inside a CUDA graph."""
import pytest
import torch
import torch.multiprocessing as mp

from nanovllm.distributed.parallel_state import local_init_method
from nanovllm.kernels.all_reduce import MAX_PROGRAMS, all_reduce_reference, one_shot_all_reduce


def test_one_shot_kernel_sums_its_peer_and_flags_it():
    """Rank 0 of two, three calls: the peer's part waits in its buffer slot of the call (by the call count's
    parity) with its flag raised; rank 0 sums in rank order, leaves its own part in its slot and raises its flag
    in the peer's flags, one per program."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    slot_elems, n = 8192, 5000
    data = [torch.zeros(2, slot_elems, device=device) for _ in range(2)]
    flags = [torch.zeros(2, MAX_PROGRAMS, dtype=torch.int32, device=device) for _ in range(2)]
    data_ptrs = torch.tensor([d.data_ptr() for d in data], device=device)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], device=device)
    epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
    for call in (1, 2, 3):
        x, peer = torch.randn(n, device=device), torch.randn(n, device=device)
        data[1][call % 2, :n] = peer
        flags[0][1, :] = call
        mine = x.clone()
        one_shot_all_reduce(x, data_ptrs, flag_ptrs, epochs, 0, slot_elems)
        assert torch.equal(x, all_reduce_reference([mine, peer]))
        assert torch.equal(data[0][call % 2, :n], mine)
        programs = -(-n // 2048)
        assert (flags[1][0, :programs] == call).all() and (flags[1][0, programs:] == 0).all()


def test_the_kernel_takes_sizes_up_to_where_it_stops_beating_nccl():
    from nanovllm.distributed.custom_all_reduce import FLOOR_BYTES, choose_max_bytes

    sizes = [256 << 10, 512 << 10, 1 << 20, 2 << 20]
    assert choose_max_bytes(sizes, [(5, 17), (9, 18), (20, 25), (30, 28)]) == 1 << 20
    assert choose_max_bytes(sizes, [(5, 17), (19, 18), (20, 25), (21, 28)]) == 256 << 10  # not past a loss
    assert choose_max_bytes(sizes, [(20, 17)] * 4) == FLOOR_BYTES
    assert choose_max_bytes(sizes, [(1, 2)] * 4) == 2 << 20


def _two_gpu_worker(rank: int, init_method: str, results):
    try:
        _two_gpu_checks(rank, init_method, results)
    except BaseException as error:  # noqa: BLE001 - the test reports it
        results.put((rank, False, repr(error)))
        raise


def _two_gpu_checks(rank: int, init_method: str, results):
    from nanovllm.distributed import parallel_state
    from nanovllm.distributed.custom_all_reduce import BUFFER_BYTES

    parallel_state.init_tensor_parallel(rank, 2, init_method, torch.device("cuda"))
    custom = parallel_state._custom
    assert custom is not None and custom.max_bytes >= 128 << 10
    checks = []
    for numel in (1, 4096, 4096 * 33 + 7, BUFFER_BYTES // 2):  # up to a whole buffer slot in bf16
        parts = [torch.randn(numel, device="cuda", dtype=torch.bfloat16,
                             generator=torch.Generator(device="cuda").manual_seed(r)) for r in range(2)]
        x, expect = parts[rank], all_reduce_reference(parts)
        for _ in range(3):  # eager, several calls: the buffers alternate
            y = x.clone()
            custom(y)
            checks.append(torch.equal(y, expect))
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(4):
                custom(static)
        for _ in range(3):
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            # four sums in a row: each rank's result is the same bits, so the next sum doubles it exactly
            checks.append(torch.equal(static, (expect.float() * 8).to(torch.bfloat16)))
    results.put((rank, all(checks), len(checks)))
    parallel_state.destroy_tensor_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_sum_as_the_reference_eagerly_and_in_graphs():
    init_method = local_init_method()
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_two_gpu_worker, args=(rank, init_method, results)) for rank in range(2)]
    for p in processes:
        p.start()
    outcome = sorted(results.get(timeout=120) for _ in processes)
    for p in processes:
        p.join(timeout=30)
    assert outcome == [(0, True, outcome[0][2]), (1, True, outcome[0][2])]
