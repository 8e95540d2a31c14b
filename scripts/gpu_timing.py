"""Timing of microsecond kernels as a decode step sees them: replayed from a CUDA graph (no launch overhead),
each call on its own copy of the data so that nothing is served from L2 that a real step would read from HBM."""
import torch

L2_FLUSH_BYTES = 256 << 20  # several times the H100's 50 MB L2


def copies_needed(nbytes: int) -> int:
    return max(2, -(-L2_FLUSH_BYTES // max(nbytes, 1)))


def graph_time(calls, replays: int = 20) -> float:
    """Seconds per call of calls (zero-argument functions, each on different data), captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up outside the capture: compiles, cuBLAS workspaces
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * len(calls))

