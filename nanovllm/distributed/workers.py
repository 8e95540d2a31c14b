"""Tensor parallelism's processes: rank 0 is the engine's own process (scheduler, sampler, detokenizer); ranks
1..N-1 are spawned here, each building the same ModelRunner over its shard of the weights (the same collectives,
CUDA graphs included, in the same order), then following rank 0: each step's command (engine/step_command.py) is
sent to them over gloo (its host values pickled, its device tensors broadcast on the devices, so rank 0 never waits
for its GPU to send one), and every rank executes it. A steady decode step's command carries no tensors: its inputs
are on every device already (the sampled tokens are broadcast inside the sampling graph). Only rank 0 samples and
reads results. A worker that fails puts its rank and traceback on a queue and exits; rank 0 raises with them at its
next step, and a watchdog ends rank 0's process where it would wait forever on the dead worker's collectives."""
import dataclasses
import logging
import math
import multiprocessing
import os
import threading
import time
import traceback
import weakref

import torch

from nanovllm.distributed.main_guard import require_main_guard
from nanovllm.distributed.parallel_state import (
    broadcast,
    broadcast_command,
    destroy_tensor_parallel,
    init_tensor_parallel,
    local_init_method,
    share_cpu_threads,
)
from nanovllm.logger import log_once, logger

LIVENESS_CHECK_S = 0.01  # while rank 0 waits for a step, it checks this often that the workers live
WATCHDOG_POLL_S, WATCHDOG_GRACE_S = 0.5, 10.0


@dataclasses.dataclass(frozen=True)
class _TensorSlot:
    """Where a device tensor stood in a command: it travels over the collectives, not in the pickle."""

    index: int
    shape: tuple
    dtype: torch.dtype


def _split(value, device: torch.device, tensors: list):
    """value with its device tensors (inside tuples, lists, dicts and dataclasses) replaced by _TensorSlots, the
    tensors appended to `tensors`."""
    if isinstance(value, torch.Tensor) and value.device.type == device.type:
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)
    return _map(value, lambda v: _split(v, device, tensors))


def _join(value, tensors: list):
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    return _map(value, lambda v: _join(v, tensors))


def _map(value, f):
    if isinstance(value, (tuple, list)):
        return type(value)(f(v) for v in value)
    if isinstance(value, dict):
        return {k: f(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{field.name: f(getattr(value, field.name))
                                             for field in dataclasses.fields(value) if field.init})
    return value


def _send_tensors(tensors: list[torch.Tensor]):
    """Rank 0's tensors, one broadcast per dtype (flattened side by side)."""
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        broadcast(torch.cat([t.reshape(-1).view(_wire_dtype(dtype)) for t in tensors if t.dtype == dtype]))


def _receive_tensors(slots: list[_TensorSlot], device: torch.device) -> list[torch.Tensor]:
    tensors: list[torch.Tensor | None] = [None] * len(slots)
    for dtype in dict.fromkeys(s.dtype for s in slots):
        group = [s for s in slots if s.dtype == dtype]
        sizes = [math.prod(s.shape) for s in group]
        flat = broadcast(torch.empty(sum(sizes), dtype=_wire_dtype(dtype), device=device))
        for slot, part in zip(group, flat.split(sizes)):
            tensors[slot.index] = part.view(dtype).view(slot.shape)
    return tensors


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # NCCL has no bool


def _worker_main(runner_class, config, rank: int, init_method: str, stop_token_ids: set[int], errors):
    runner = None
    try:
        device = torch.device(config.device)
        if device.type == "cpu":
            share_cpu_threads(config.tensor_parallel_size)
        init_tensor_parallel(rank, config.tensor_parallel_size, init_method, device,
                             not config.disable_custom_all_reduce)
        runner = runner_class(config, stop_token_ids)
        with torch.inference_mode():
            while (message := broadcast_command()) is not None:
                command, slots = message
                runner.execute(_join(command, _receive_tensors(slots, device)))
    except BaseException:  # noqa: BLE001 - any failure ends the job, with its rank
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        _release(runner.captured_graphs() if runner is not None else [])


class TensorParallelWorkers:
    """Ranks 1..N-1, started before rank 0 builds its ModelRunner; follow() makes rank 0's runner lead them."""

    def __init__(self, runner_class, config, stop_token_ids: set[int]):
        """runner_class: the engine's ModelRunner, which each rank builds (passed in: distributed/ sits below the
        engine)."""
        size = config.tensor_parallel_size
        require_main_guard(f"tensor_parallel_size={size}")
        init_method = local_init_method()
        context = multiprocessing.get_context("spawn")
        self.errors = context.Queue()
        self.processes = [context.Process(target=_worker_main, daemon=True, name=f"nanovllm-tp{rank}",
                                          args=(runner_class, config, rank, init_method, stop_token_ids, self.errors))
                          for rank in range(1, size)]
        for process in self.processes:
            process.start()
        device = torch.device(config.device)
        if device.type == "cpu":
            share_cpu_threads(size)
        log_once(f"tensor parallel over {size} {'GPUs' if device.type == 'cuda' else 'CPU processes (gloo)'}", logging.DEBUG)
        self._reported = threading.Event()  # rank 0 has raised a worker's failure (the watchdog then lets it be)
        self._closing = threading.Event()
        # rank 0's CUDA graphs, once followed: freed before the communicator (held here, not through the runner,
        # whose weak reference is already cleared when the garbage collector drops the engine)
        self._graphs: list[dict] = []
        self._finalizer = weakref.finalize(self, _shut_down, self.processes, self._closing, self._graphs)
        threading.Thread(target=_watch, args=(self.processes, self.errors, self._closing, self._reported), daemon=True,
                         name="nanovllm-tp-watchdog").start()
        init_tensor_parallel(0, size, init_method, device, not config.disable_custom_all_reduce)

    def follow(self, runner):
        """Send every step of rank 0's runner to the other ranks (its device tensors by broadcast, without waiting for
        the device), and watch them while rank 0 waits for a step."""
        self.device = runner.device
        self._graphs.extend(runner.captured_graphs())
        runner.followers = self

    def lead(self, command, run):
        """Send a step command to the other ranks (its device tensors by broadcast), then run it here: run()."""
        tensors = []
        message = (_split(command, self.device, tensors), [_TensorSlot(i, tuple(t.shape), t.dtype)
                                                            for i, t in enumerate(tensors)])
        self._send(message)
        try:
            _send_tensors(tensors)
            return run()
        except RuntimeError as error:
            raise self._worker_error(error) from error

    def wait_for(self, event: torch.cuda.Event):
        """event.synchronize(), except that a dead worker (whose peers' collectives never end) raises."""
        checked = time.monotonic()
        while not event.query():
            if time.monotonic() - checked > LIVENESS_CHECK_S:
                checked = time.monotonic()
                if _dead(self.processes):
                    raise self._worker_error(RuntimeError("a worker exited while rank 0 waited for a step"))

    def _send(self, command):
        if dead := _dead(self.processes):
            raise self._worker_error(RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}"))
        try:
            broadcast_command(command)
        except RuntimeError as error:
            raise self._worker_error(error) from error

    def _worker_error(self, error: Exception) -> RuntimeError:
        self._reported.set()
        return _worker_error(self.errors, error)

    def close(self):
        """End the workers."""
        self._finalizer()

    def abort(self):
        """End the workers at once (rank 0 failed while they may wait in a collective)."""
        self._closing.set()
        for process in self.processes:
            process.kill()
            process.join(timeout=10)
        self._finalizer()


def _dead(processes) -> list:
    return [p for p in processes if not p.is_alive()]


def _worker_error(errors, error: Exception) -> RuntimeError:
    """The failed worker's rank and traceback, from its report (else the collective's own error)."""
    try:
        rank, trace = errors.get(timeout=5)
    except Exception:  # noqa: BLE001 - no report: the collective's own error says what happened
        return RuntimeError(f"tensor parallel: a worker failed ({error})")
    return RuntimeError(f"tensor parallel worker rank {rank} failed:\n{trace}")


def _watch(processes, errors, closing: threading.Event, reported: threading.Event):
    """A worker that dies can leave rank 0 blocked in a device collective that never ends (while the model is built,
    or on a read of a step's results), where no exception reaches it. Rank 0 raises by itself where it waits for a
    step (_wait_for) or sends a command; otherwise, after a grace period, this watchdog reports the worker's error
    and ends the process: an error, never a hang. (A function, not a method: the thread must not keep the workers'
    owner alive.)"""
    while not closing.wait(WATCHDOG_POLL_S):
        dead = _dead(processes)
        if dead and not closing.wait(WATCHDOG_GRACE_S) and not reported.is_set():
            logger.error(f"{_worker_error(errors, RuntimeError(f'{dead[0].name} exited'))}\nrank 0 is blocked on the "
                         "dead worker's collectives: exiting")
            os._exit(1)


def _release(graph_dicts: list[dict]):
    """The CUDA graphs first, now rather than when Python drops them: a graph that captured NCCL calls holds a
    reference on the communicator, and aborting the communicator waits until none is left."""
    for graphs in graph_dicts:
        for graph in graphs.values():
            graph.reset()
        graphs.clear()
    destroy_tensor_parallel()


def _shut_down(processes, closing: threading.Event, graph_dicts: list[dict]):
    closing.set()
    try:
        if any(p.is_alive() for p in processes):
            broadcast_command(None)
    except RuntimeError:
        pass
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    _release(graph_dicts)
