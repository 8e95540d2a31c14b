"""Data parallelism without Ray: LLM(model, data_parallel_size=N) keeps one engine in the caller's process and
N-1 more in spawned processes (each on its own GPUs: with tensor_parallel_size T, replica i sees only GPUs
i*T..i*T+T-1, and replica 0 uses the first T; on CPU each takes its share of the cores). generate() deals a call's
requests out so that each replica gets an even share of the prompt tokens and of the output tokens (`deal`), runs its
own share while the others run theirs, and gives every output back in input order. A replica that fails or dies
fails the call with its number and error."""
import contextlib
import multiprocessing
import os
import traceback
import weakref

from nanovllm.outputs import RequestOutput


def _replica_main(index: int, replicas: int, model: str, engine_kwargs: dict, connection):
    try:
        if engine_kwargs.get("device", "auto") != "cpu":  # the index-th T GPUs the caller sees, before CUDA starts
            tp = engine_kwargs.get("tensor_parallel_size", 1)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = visible.split(",") if visible else [str(i) for i in range((index + 1) * tp)]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[index * tp:(index + 1) * tp])
        import torch

        from nanovllm import LLM
        from nanovllm.distributed.parallel_state import share_cpu_threads

        if engine_kwargs.get("device") == "cpu" or not torch.cuda.is_available():
            share_cpu_threads(replicas)
        llm = LLM(model, **engine_kwargs)
        connection.send(("ready", None))
        while (message := connection.recv()) is not None:
            connection.send(("outputs", llm._run(message, use_tqdm=False)))
    except EOFError:  # the caller is gone
        pass
    except BaseException:  # noqa: BLE001 - reported to the caller, which fails the call
        with contextlib.suppress(OSError):
            connection.send(("error", traceback.format_exc()))


def deal(requests: list, size: int) -> list[list[int]]:
    """The indices of the requests each replica runs: the largest first, each to the replica whose larger share of
    the call's prompt tokens or of its max_tokens grows least. Both count: prefill steps cost by the prompt token and
    decode steps by the output token, and a replica with more of either finishes last."""
    prompt = [len(token_ids) for _, token_ids, _ in requests]
    output = [params.max_tokens or 0 for _, _, params in requests]
    prompt_total, output_total = sum(prompt) or 1, sum(output) or 1
    work = [(p / prompt_total, o / output_total) for p, o in zip(prompt, output)]
    loads, shares = [(0.0, 0.0)] * size, [[] for _ in range(size)]
    for i in sorted(range(len(requests)), key=lambda i: -sum(work[i])):
        grown = [(load[0] + work[i][0], load[1] + work[i][1]) for load in loads]
        replica = min(range(size), key=lambda r: max(grown[r]))
        loads[replica] = grown[replica]
        shares[replica].append(i)
    return shares


class DataParallelReplicas:
    """Replicas 1..N-1 (replica 0 is the caller's own engine)."""

    def __init__(self, size: int, model: str, engine_kwargs: dict):
        context = multiprocessing.get_context("spawn")
        self.connections, self.processes = [], []
        # a daemonic process may not start processes: a replica with tensor parallelism starts its ranks
        daemon = engine_kwargs.get("tensor_parallel_size", 1) == 1
        for index in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_replica_main, daemon=daemon, name=f"nanovllm-dp{index}",
                                      args=(index, size, model, engine_kwargs, theirs))
            process.start()
            self.connections.append(ours)
            self.processes.append(process)
        self._finalizer = weakref.finalize(self, _close, self.connections, self.processes)
        for index in range(1, size):
            self._receive(index)

    def _died(self, index: int) -> RuntimeError:
        process = self.processes[index - 1]
        process.join(timeout=5)
        return RuntimeError(f"data parallel replica {index} died (exit code {process.exitcode})")

    def _send(self, index: int, message):
        try:
            self.connections[index - 1].send(message)
        except (BrokenPipeError, OSError):
            raise self._died(index) from None

    def _receive(self, index: int):
        try:
            kind, value = self.connections[index - 1].recv()
        except EOFError:
            raise self._died(index) from None
        if kind == "error":
            raise RuntimeError(f"data parallel replica {index} failed:\n{value}")
        return value

    def run(self, requests: list, run_local) -> list[RequestOutput]:
        """requests: (text, token ids, params) each; run_local runs replica 0's share in this process."""
        shares = deal(requests, len(self.processes) + 1)
        size = len(shares)
        for index in range(1, size):
            self._send(index, [requests[i] for i in shares[index]])
        outputs: list[RequestOutput | None] = [None] * len(requests)
        for i, output in zip(shares[0], run_local([requests[i] for i in shares[0]])):
            outputs[i] = output
        for index in range(1, size):
            for i, output in zip(shares[index], self._receive(index)):
                output.request_id = f"dp{index}-{output.request_id}"
                outputs[i] = output
        return outputs

    def close(self):
        self._finalizer()


def _close(connections, processes):
    for connection, process in zip(connections, processes):
        with contextlib.suppress(OSError):
            connection.send(None)
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
