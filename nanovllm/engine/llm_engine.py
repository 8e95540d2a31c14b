from dataclasses import dataclass, field
from itertools import count

import numpy as np

from nanovllm.config import Config
from nanovllm.distributed.workers import TensorParallelWorkers
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import NoProgressError, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.kvcache.state_slots import StateSlots
from nanovllm.layers.logprobs import TokenLogprobs
from nanovllm.logger import log_once
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.weights.model_files import load_tokenizer


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer | None] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class LLMEngine:
    """Requests in, RequestOutputs out: owns the tokenizer, scheduler, block manager and model runner."""

    def __init__(self, config: Config):
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(self.model_config.model, self.model_config.tokenizer)
        self.eos_token_ids = self._eos_token_ids()
        self.workers = TensorParallelWorkers(ModelRunner, config, set(self.eos_token_ids)) \
            if config.tensor_parallel_size > 1 else None
        try:
            self.model_runner = ModelRunner(config, set(self.eos_token_ids))
        except BaseException:
            if self.workers is not None:
                self.workers.abort()  # they may wait in a collective that rank 0 will not join
            raise
        if self.workers is not None:
            self.workers.follow(self.model_runner)
        kv = self.model_runner.plan.kv
        if config.enable_prefix_caching and kv.prefix_caching_off:
            log_once(f"prefix caching is off: {kv.prefix_caching_off}")
        self.block_manager = BlockManager(kv.num_gpu_blocks, config.block_size,
                                          config.enable_prefix_caching and not kv.prefix_caching_off,
                                          self.model_runner.host_pool,
                                          StateSlots(kv.num_state_slots) if kv.num_state_slots else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.model_runner.layer_major is not None, self.model_runner.preemption)
        self.requests: dict[str, Request] = {}
        self._seed_rng = np.random.default_rng(config.seed)
        self._arrival = count()
        self._in_flight = None  # a launched step whose tokens are not read yet (async scheduling)
        self.num_steps_ahead = 0  # statistics: steps launched before the previous step's tokens were read
        self._steps_without_a_token = 0

    def shutdown(self):
        """End the tensor-parallel workers; the rest goes with the last reference."""
        if self.workers is not None:
            self.workers.close()
        self._in_flight = None

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> "LLMEngine":
        return cls(Config(model=model, **kwargs))

    def _eos_token_ids(self) -> list[int]:
        ids = _as_list(getattr(self.model_config.hf_config, "eos_token_id", None))
        if self.model_config.format != "gguf":
            try:
                from transformers import GenerationConfig

                ids += _as_list(GenerationConfig.from_pretrained(self.model_config.model).eos_token_id)
            except OSError:
                pass  # no generation_config.json
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    # ---- requests -------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams):
        """Raise ValueError before any work if this prompt can't run."""
        n = len(prompt_token_ids)
        max_len = self.model_config.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n > max_len:
            raise ValueError(f"the prompt has {n} tokens, more than max_model_len={max_len}: shorten it or "
                             "raise max_model_len")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}) (the vocabulary); got {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids must be in [0, {vocab}); got {bad[:5]}")
        if params.stop_strings and not params.detokenize:
            raise ValueError("SamplingParams.stop strings need detokenize=True")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None):
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate_prompt(prompt_token_ids, params)
        request = Request(request_id, prompt, prompt_token_ids, params)
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 1 << 62))
        for index in range(params.n):
            seed = hash((base_seed, index)) & 0xFFFFFFFF
            seq = Sequence(request_id, index, prompt_token_ids, params, seed, next(self._arrival))
            request.seqs.append(seq)
            request.detokenizers.append(IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                params.spaces_between_special_tokens) if params.detokenize else None)
            self.scheduler.add(seq)
        self.requests[request_id] = request

    def abort_request(self, request_ids: str | list[str]):
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.pop(rid, None)
            for seq in request.seqs if request else []:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Unfinished requests, or a step launched ahead whose tokens are still to be read (its requests aborted)."""
        return bool(self.requests) or self._in_flight is not None

    # ---- steps ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the requests that finished in it. With async scheduling, a decode
        batch's next step is launched before this one's tokens are read back, so the host's bookkeeping
        overlaps the device's work."""
        if self._in_flight is not None:
            handle, self._in_flight = self._in_flight, None
        else:
            scheduled = self.scheduler.schedule()
            if not scheduled.seqs:
                return []
            handle = self.model_runner.launch(scheduled.seqs, scheduled.block_copies)
        live = [s for s in handle.seqs if not s.is_finished]  # a pipelined step may hold seqs that finished
        ahead = self._launch_ahead(handle, live)
        if ahead is None:
            self.scheduler.finish_step(live)
        result = self.model_runner.collect(handle)
        self._check_progress(result.sampled)
        done = []
        for seq, token, logprobs, prompt_lps in zip(handle.seqs, result.sampled, result.logprobs,
                                                    result.prompt_logprobs):
            if seq.is_finished:  # finished at an earlier step: its row here was void
                continue
            request = self.requests[seq.request_id]
            if seq.wants_prompt_logprobs:
                self._add_prompt_logprobs(seq, prompt_lps)
            if token is None:
                continue
            if ahead is not None:
                seq.remove_placeholder()
            self._append_token(request, seq, token, logprobs)
            if request.finished:
                done.append(self.requests.pop(seq.request_id))
        if ahead is not None:
            if all(s.is_finished for s in ahead.seqs):
                self.model_runner.collect(ahead)  # nothing left to use it: drain it
            else:
                self._in_flight = ahead
        return [self._request_output(r) for r in done]

    def _check_progress(self, sampled: list[int | None]):
        """Raise NoProgressError where steps go on without sampling a token for longer than computing every
        unfinished sequence's tokens four times over takes (each step computes at least one): preemptions that
        undo one another would otherwise spin for ever."""
        if any(token is not None for token in sampled):
            self._steps_without_a_token = 0
            return
        self._steps_without_a_token += 1
        if self._steps_without_a_token < 64:
            return
        seqs = self.scheduler.running + list(self.scheduler.waiting)
        if self._steps_without_a_token > 4 * sum(seq.num_tokens for seq in seqs):
            raise NoProgressError(f"{self._steps_without_a_token} steps ran without sampling a token for any of "
                                  f"{len(seqs)} sequences: preemptions undo each other's work. Give the KV cache more "
                                  "room (gpu_memory_utilization, kv_cache_memory_bytes, num_gpu_blocks_override or "
                                  "kv_offloading_size) or lower max_num_seqs")

    def _launch_ahead(self, handle, live: list[Sequence]):
        """Launch the next step (live's decodes, fed by this step's tokens still on the device, and prompt chunks),
        or return None."""
        if not self.config.async_scheduling or not live:
            return None
        row_of = {i: j for j, i in enumerate(handle.sample_idx)}
        token_row = {}  # live seq -> its row of this step's sampled tokens
        for i, seq in enumerate(handle.seqs):
            if seq.is_finished:
                continue
            if seq.params.has_penalties:  # penalties count the tokens: they must be known
                return None
            if i in row_of:
                token_row[id(seq)] = row_of[i]
        if all(id(seq) in token_row and self._at_length(seq, 1) for seq in live):
            return None  # this step's tokens end every live sequence: a step ahead would be thrown away
        scheduled = self.scheduler.schedule_ahead(live, [id(seq) in token_row for seq in live])
        if scheduled is None:
            return None
        src, dst, row = [], [], 0
        for seq in scheduled.seqs:
            if id(seq) in token_row:  # its one new token is the placeholder
                src.append(token_row[id(seq)])
                dst.append(row)
            row += seq.num_scheduled_tokens
        self.num_steps_ahead += 1
        return self.model_runner.launch(scheduled.seqs, scheduled.block_copies, input_ids_from=(handle.tokens, src, dst))

    def _append_token(self, request: Request, seq: Sequence, token: int, logprobs: TokenLogprobs | None):
        params = seq.params
        seq.append_token(token)
        if logprobs is not None:
            seq.output_logprobs.append(self._logprob_dict(logprobs, params.logprobs, params.detokenize))
            seq.cumulative_logprob += logprobs.logprob
        past_min = seq.num_output_tokens >= params.min_tokens
        if past_min and token in params.stop_token_ids:
            return self.scheduler.finish(seq, "stop", token)
        if past_min and not params.ignore_eos and token in self.eos_token_ids:
            return self.scheduler.finish(seq, "stop", None)
        detok = request.detokenizers[seq.index]
        if detok is not None:
            delta = detok.step(token)
            seq.text += delta
            if past_min and delta and self._check_stop_strings(seq, len(delta)):
                return
        if self._at_length(seq):
            if detok is not None:
                seq.text += detok.flush()
            self.scheduler.finish(seq, "length")

    def _at_length(self, seq: Sequence, pending: int = 0) -> bool:
        """Whether seq is at its length limit (max_tokens, or max_model_len) once `pending` more tokens are in."""
        max_tokens = seq.params.max_tokens or self.model_config.max_model_len
        return (seq.num_output_tokens + pending >= max_tokens
                or seq.num_tokens + pending >= self.model_config.max_model_len)

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> bool:
        for stop in seq.params.stop_strings:
            from_pos = max(0, len(seq.text) - delta_len - len(stop) + 1)
            at = seq.text.find(stop, from_pos)
            if at >= 0:
                keep = at + len(stop) if seq.params.include_stop_str_in_output else at
                seq.text = seq.text[:keep]
                self.scheduler.finish(seq, "stop", stop)
                return True
        return False

    def _decoded(self, token_id: int, detokenize: bool) -> str | None:
        return self.tokenizer.decode([token_id]) if detokenize else None

    def _logprob_dict(self, lp: TokenLogprobs, k: int, detokenize: bool) -> dict[int, Logprob]:
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, self._decoded(lp.token_id, detokenize))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k]), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, self._decoded(tid, detokenize))
        return entry

    def _add_prompt_logprobs(self, seq: Sequence, entries: list[TokenLogprobs]):
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first prompt token has no context
        k, detok = seq.params.prompt_logprobs, seq.params.detokenize
        seq.prompt_logprobs.extend(self._logprob_dict(e, k, detok) for e in entries)

    def _request_output(self, request: Request) -> RequestOutput:
        first = request.seqs[0]
        completions = [
            CompletionOutput(
                index=s.index, text=s.text, token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=s.output_logprobs if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason)
            for s in request.seqs]
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs if request.params.prompt_logprobs is not None else None,
            outputs=completions, finished=True, num_cached_tokens=first.num_cached_tokens)
