"""Tensor parallelism's processes: rank 0 is the engine's own process (scheduler, sampler, detokenizer); ranks
1..N-1 are spawned here, each building the same ModelRunner over its shard of the weights (the same collectives
in the same order), then following rank 0: before each forward, each LM head call and each KV block copy of the
host pool, rank 0 broadcasts the call's inputs, and every rank runs it (its all-reduces and the logits' gather
pair up). Only rank 0's results are read. A worker that fails puts its rank and traceback on a queue and exits;
rank 0's next collective then fails, and the error names the rank."""
import dataclasses
import multiprocessing
import socket
import traceback
import weakref

import torch

from nanovllm.distributed.parallel_state import (
    broadcast_command,
    destroy_tensor_parallel,
    init_tensor_parallel,
    share_cpu_threads,
)
from nanovllm.logger import log_once


def _moved(value, device: torch.device):
    """value with its tensors (inside tuples, lists and dataclasses) on device."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _moved(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def _worker_main(config, rank: int, init_method: str, stop_token_ids: set[int], errors):
    try:
        from nanovllm.engine.model_runner import ModelRunner

        device = torch.device(config.device)
        if device.type == "cpu":
            share_cpu_threads(config.tensor_parallel_size)
        init_tensor_parallel(rank, config.tensor_parallel_size, init_method, device)
        runner = ModelRunner(config, stop_token_ids)
        calls = {"forward": runner.model, "logits": runner.model.compute_logits}
        if runner.host_pool is not None:
            calls.update(copy_out=runner.host_pool._copy_out, copy_in=runner.host_pool._copy_in)
        with torch.inference_mode():
            while (command := broadcast_command())[0] != "exit":
                kind, *args = _moved(command, device)
                calls[kind](*args)
    except BaseException:  # noqa: BLE001 - any failure ends the job, with its rank
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        destroy_tensor_parallel()


class TensorParallelWorkers:
    """Ranks 1..N-1, started before rank 0 builds its ModelRunner; follow() makes rank 0's model lead them."""

    def __init__(self, config, stop_token_ids: set[int]):
        size = config.tensor_parallel_size
        with socket.socket() as s:  # a free port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        context = multiprocessing.get_context("spawn")
        self.errors = context.Queue()
        self.processes = [context.Process(target=_worker_main, daemon=True, name=f"nanovllm-tp{rank}",
                                          args=(config, rank, init_method, stop_token_ids, self.errors))
                          for rank in range(1, size)]
        for process in self.processes:
            process.start()
        device = torch.device(config.device)
        if device.type == "cpu":
            share_cpu_threads(size)
        log_once(f"tensor parallel over {size} {'GPUs (NCCL)' if device.type == 'cuda' else 'CPU processes (gloo)'}")
        init_tensor_parallel(0, size, init_method, device)
        self._finalizer = weakref.finalize(self, _shut_down, self.processes)

    def follow(self, runner):
        """Make every forward and LM head call of rank 0's model, and every KV block copy of its host pool (swap,
        offload, prefix tier: each rank moves its heads' part), run on every rank."""
        model, pool = runner.model, runner.host_pool
        forward, compute_logits = model.forward, model.compute_logits

        def lead(kind, call, *args):
            self._send((kind, *_moved(args, torch.device("cpu"))))
            try:
                return call(*args)
            except RuntimeError as error:
                raise self._worker_error(error) from error

        model.forward = lambda input_ids, positions, meta, inputs_embeds=None: lead(
            "forward", forward, input_ids, positions, meta)
        model.compute_logits = lambda hidden, out=None: lead("logits", compute_logits, hidden)
        if pool is not None:
            copy_out, copy_in = pool._copy_out, pool._copy_in
            pool._copy_out = lambda device_blocks, pool_blocks: lead("copy_out", copy_out, device_blocks, pool_blocks)
            pool._copy_in = lambda pool_blocks, device_blocks: lead("copy_in", copy_in, pool_blocks, device_blocks)

    def _send(self, command):
        dead = [p for p in self.processes if not p.is_alive()]
        if dead:
            raise self._worker_error(RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}"))
        try:
            broadcast_command(command)
        except RuntimeError as error:
            raise self._worker_error(error) from error

    def _worker_error(self, error: Exception) -> RuntimeError:
        try:
            rank, trace = self.errors.get(timeout=5)
        except Exception:  # noqa: BLE001 - no report: the collective's own error says what happened
            return RuntimeError(f"tensor parallel: a worker failed ({error})")
        return RuntimeError(f"tensor parallel worker rank {rank} failed:\n{trace}")

    def close(self):
        self._finalizer()


def _shut_down(processes):
    try:
        if any(p.is_alive() for p in processes):
            broadcast_command(("exit",))
    except RuntimeError:
        pass
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    destroy_tensor_parallel()
