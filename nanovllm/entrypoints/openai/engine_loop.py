"""The server's engine side: one loop that steps the engine while any request is unfinished, so that requests
arriving at any time join the running batches and leave them when done. It runs in a process of its own
(entrypoints/openai/engine_client.py starts it): the HTTP handlers' work would otherwise take the interpreter from
the engine's host loop, which the engine's throughput depends on.

Commands arrive on a pipe: ("add", request id, prompt, params), ("abort", request id), ("stats",), ("close",). A
prompt is ("ids", token ids), ("text", str) or ("chat", messages); the loop tokenizes it, checks it and answers
with a first delta (its token count, or the error). After each step one message carries every request's delta: the
text and tokens it gained since the last (the last characters that a stop string may still cut are held back until
the request finishes). Deltas are plain tuples, which pickle several times faster than objects (the loop sends
hundreds a step):
    delta:      (request id, completions, prompt tokens, error or None)
    completion: (text, token ids, logprobs or None (a dict token id -> Logprob a token), finish reason or None)"""
import queue
import threading
import time

from nanovllm.logger import logger
from nanovllm.sampling_params import SamplingParams


def engine_info(llm) -> dict:
    """What the routes show of the model."""
    mc = llm.llm_engine.model_config
    return {"max_model_len": mc.max_model_len, "architecture": mc.hf_config.architectures[0],
            "model_type": mc.hf_config.model_type, "format": mc.format,
            "quantization": mc.quantization or str(mc.dtype).removeprefix("torch.")}


class EngineLoop:
    def __init__(self, llm, send):
        """send(message): to the server; a step's deltas as a list, or a command's answer."""
        self.llm, self.engine, self.send = llm, llm.llm_engine, send
        self.inbox: queue.Queue = queue.Queue()
        self.sent: dict[str, list[list[int]]] = {}  # request id -> per completion [characters, tokens] sent
        self.hold: dict[str, int] = {}  # request id -> characters a stop string may still cut
        self.max_batch = 0  # the most sequences a step has run (stats)
        self.steps, self.step_seconds = 0, 0.0  # steps run and the time spent in them (stats)

    def run(self):
        while True:
            if not self._take_inbox(block=not self.engine.has_work()):
                return
            if not self.engine.has_work():
                continue
            self.max_batch = max(self.max_batch, len(self.engine.scheduler.running))
            start = time.perf_counter()
            try:
                finished = {out.request_id: out for out in self.engine.step()}
            except Exception as e:  # noqa: BLE001 - the step's requests fail with it; the loop serves the next ones
                logger.exception("an engine step failed")
                self._fail_all(f"the engine step failed: {e}")
                continue
            self.steps, self.step_seconds = self.steps + 1, self.step_seconds + time.perf_counter() - start
            deltas = [d for request_id in list(self.sent) if (d := self._delta(request_id, finished)) is not None]
            if deltas:
                self.send(deltas)

    def _take_inbox(self, block: bool) -> bool:
        """Run the commands waiting (wait for one if block); False on close."""
        while True:
            try:
                command = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort" and self.sent.pop(command[1], None) is not None:
                self.engine.abort_request(command[1])
            elif kind == "stats":
                bm = self.engine.block_manager
                self.send({"unfinished": self.engine.has_unfinished_requests(), "max_batch": self.max_batch,
                           "free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks, "steps": self.steps,
                           "step_seconds": self.step_seconds, "cpu_seconds": time.process_time()})
            elif kind == "close":
                return False

    def _add(self, request_id: str, prompt: tuple, params: SamplingParams):
        try:
            ids = self._tokenize(prompt)
            self.engine.add_request(request_id, ids, params)
        except ValueError as e:
            self.send([(request_id, (), 0, str(e))])
            return
        self.sent[request_id] = [[0, 0] for _ in range(params.n)]
        self.hold[request_id] = max((len(s) for s in params.stop_strings), default=1) - 1
        self.send([(request_id, (), len(ids), None)])

    def _tokenize(self, prompt: tuple) -> list[int]:
        kind, value = prompt
        if kind == "text":
            return self.llm.get_tokenizer()(value).input_ids
        if kind == "chat":
            return self.llm.chat_prompt(value)["prompt_token_ids"]
        return value

    def _delta(self, request_id: str, finished: dict) -> tuple | None:
        """What the request gained since its last delta (None: nothing; a finished request is forgotten)."""
        output, sent = finished.get(request_id), self.sent[request_id]
        if output is not None:
            completions = [(c.text, c.token_ids[n:], c.logprobs[n:] if c.logprobs is not None else None,
                            c.finish_reason) for c, (_, n) in zip(output.outputs, sent)]
        elif (request := self.engine.requests.get(request_id)) is not None:
            completions = [(s.text, s.sampled_tokens(n), s.output_logprobs[n:] if s.params.logprobs is not None else None,
                            s.finish_reason) for s, (_, n) in zip(request.seqs, sent)]
        else:
            return None
        hold, gained = self.hold[request_id], []
        for (text, new_ids, new_logprobs, reason), counts in zip(completions, sent):
            end = len(text) if reason is not None else max(counts[0], len(text) - hold)
            gained.append((text[counts[0]:end], new_ids, new_logprobs, reason))
            counts[0], counts[1] = end, counts[1] + len(new_ids)
        if output is not None:
            del self.sent[request_id], self.hold[request_id]
        elif not any(text or ids for text, ids, _, _ in gained):
            return None
        return request_id, tuple(gained), 0, None

    def _fail_all(self, message: str):
        for request_id in self.sent:
            self.engine.abort_request(request_id)
        self.send([(request_id, (), 0, message) for request_id in self.sent])
        self.sent.clear()
        self.hold.clear()


def run_engine_process(model: str, engine_kwargs: dict, conn):
    """The engine process: build the engine, say what it serves, then run the loop; commands come in on a thread
    (it waits on the pipe, not holding the interpreter)."""
    from nanovllm import LLM

    try:
        llm = LLM(model, **engine_kwargs)
    except Exception as e:  # noqa: BLE001 - the server reports it and exits
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    loop = EngineLoop(llm, conn.send)
    conn.send(engine_info(llm))

    def receive():
        while True:
            try:
                command = conn.recv()
            except EOFError:  # the server went away
                command = ("close",)
            loop.inbox.put(command)
            if command[0] == "close":
                return

    threading.Thread(target=receive, daemon=True, name="nanovllm-engine-commands").start()
    loop.run()
