"""`nanovllm run-batch -i INPUT -o OUTPUT --model MODEL` (vLLM's run-batch): an OpenAI batch file through one LLM.

Requests run in chunks of --chunk-size; each chunk's results are appended to OUTPUT in input order and flushed
before the next chunk starts, so a job stopped halfway and started again with the same files resumes: the
custom_ids already in OUTPUT are not run again (a torn last line is cut off first). A line that cannot be served
goes to the errors file (default OUTPUT.errors.jsonl) with its line number and the reason, and the job goes on."""
import argparse
import json
import os
import re

from tqdm import tqdm

from nanovllm.entrypoints.engine_flags import add_engine_arguments, engine_kwargs
from nanovllm.entrypoints.openai_batch import CHAT, BadRequest, BatchRequest, error_line, output_line, parse_request


def add_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("-i", "--input-file", required=True, help="the OpenAI batch file (JSONL)")
    parser.add_argument("-o", "--output-file", required=True, help="results (JSONL), appended to when resuming")
    parser.add_argument("--model", required=True, help="an HF model directory or a GGUF file")
    parser.add_argument("--errors-file", default=None, help="default: OUTPUT.errors.jsonl")
    parser.add_argument("--served-model-name", default=None, help="the model name in the results (default: --model)")
    parser.add_argument("--chunk-size", type=int, default=1024,
                        help="requests a generate call: a stopped job loses at most one chunk's work")
    add_engine_arguments(parser)
    parser.add_argument("--ray", action="store_true", help="serve each chunk on a Ray cluster (ray.init() joins the "
                        "one RAY_ADDRESS names, else starts a local one), one LLM a replica")
    parser.add_argument("--ray-replicas", type=int, default=1, help="with --ray: LLM replicas (a GPU each where the "
                        "cluster has GPUs)")


def run(args) -> int:
    if args.chunk_size < 1:
        raise ValueError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    errors_file = args.errors_file or args.output_file + ".errors.jsonl"
    done, failed = read_written(args.output_file, "custom_id"), read_written(errors_file, "line")
    requests, errors = read_requests(args.input_file, done, failed)
    with open(errors_file, "a") as errors_out:
        def report(entry: dict):
            errors_out.write(json.dumps(entry) + "\n")
            errors_out.flush()

        for entry in errors:
            report(entry)
        served = 0
        if requests:
            model = args.served_model_name or args.model
            serve_lines = ray_server(args, model) if args.ray else local_server(args, model)
            with open(args.output_file, "a") as out, tqdm(total=len(requests), desc="Requests") as bar:
                for start in range(0, len(requests), args.chunk_size):
                    chunk = requests[start:start + args.chunk_size]
                    for line in serve_lines(chunk, report):
                        out.write(json.dumps(line) + "\n")
                        served += 1
                    out.flush()
                    os.fsync(out.fileno())
                    bar.update(len(chunk))
    print(f"run-batch: {served} requests served into {args.output_file}, {len(done)} there from before; "
          f"{len(read_written(errors_file, 'line'))} lines not served ({errors_file})")
    return 0


def local_server(args, model: str):
    """chunk, report -> the chunk's output lines in order, by one LLM in this process."""
    from nanovllm import LLM  # heavy: after the input is read and checked

    llm = LLM(args.model, **engine_kwargs(args))
    return lambda chunk, report: [output_line(request, output, model) for request, output in serve(llm, chunk, report)]


def ray_server(args, model: str):
    """chunk, report -> the chunk's output lines in order, by --ray-replicas LLMs on a Ray cluster (each replica
    parses and serves its rows' lines as the local server does)."""
    import ray

    from nanovllm.entrypoints.ray_data import ProcessorConfig, build_processor

    config = ProcessorConfig(args.model, engine_kwargs(args), concurrency=args.ray_replicas,
                             batch_size=max(1, args.chunk_size // args.ray_replicas))
    process = build_processor(config, stage=BatchLineStage, stage_kwargs=dict(served_model=model))

    def serve_lines(chunk: list[BatchRequest], report) -> list[dict]:
        rows = process(ray.data.from_items([{"line": r.line, "text": json.dumps(
            {"custom_id": r.custom_id, "method": "POST", "url": r.url, "body": r.body})} for r in chunk])).take_all()
        lines = []
        for row in sorted(rows, key=lambda row: row["line"]):
            for entry in json.loads(row["errors"]):
                report(entry)
            if row["output"]:
                lines.append(json.loads(row["output"]))
        return lines

    return serve_lines


class BatchLineStage:
    """A Ray replica of run-batch: rows of (line, text) -> their output line and error entries, as JSON."""

    def __init__(self, model: str, engine_kwargs: dict, served_model: str):
        from nanovllm import LLM

        self.llm, self.served_model = LLM(model, **engine_kwargs), served_model

    def __call__(self, batch):
        errors = {line: [] for line in batch["line"]}
        requests = [parse_request(line, text) for line, text in zip(batch["line"], batch["text"])]
        served = {r.line: output for r, output in serve(self.llm, requests, lambda e: errors[e["line"]].append(e))}
        batch = batch.copy()
        batch["output"] = [json.dumps(output_line(r, served[r.line], self.served_model)) if r.line in served else ""
                           for r in requests]
        batch["errors"] = [json.dumps(errors[line]) for line in batch["line"]]
        return batch


def read_written(path: str, key: str) -> set:
    """The `key` of every complete line of a results or errors file (none where there is no file); a torn last
    line, left by a stopped job, is cut off."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
    return {json.loads(line)[key] for line in data[:end].splitlines() if line.strip()}


def read_requests(path: str, done: set, failed: set) -> tuple[list[BatchRequest], list[dict]]:
    """The requests still to serve, and error entries for the lines newly found bad (a custom_id seen twice
    included)."""
    requests, errors, seen = [], [], set(done)
    with open(path) as f:
        for number, text in enumerate(f, start=1):
            if not text.strip() or number in failed:
                continue
            try:
                request = parse_request(number, text)
            except BadRequest as e:
                errors.append(error_line(number, _custom_id(text), str(e)))
                continue
            if request.custom_id in seen:
                if request.custom_id not in done:
                    errors.append(error_line(number, request.custom_id, "custom_id repeats an earlier line's"))
                continue
            seen.add(request.custom_id)
            requests.append(request)
    return requests, errors


def serve(llm, chunk: list[BatchRequest], report) -> list:
    """(request, RequestOutput) of each request of the chunk that the engine takes, in order; the others are
    reported (a chat template that fails, a prompt the engine refuses) and left out."""
    ready = []
    for request in chunk:
        try:
            prompt = llm.chat_prompt(request.body["messages"]) if request.url == CHAT else \
                {"prompt": request.body["prompt"]}
        except Exception as e:  # noqa: BLE001 - any template error is this request's, not the job's
            report(error_line(request.line, request.custom_id, f"chat template: {e}"))
            continue
        ready.append((request, prompt))
    while ready:
        try:
            outputs = llm.generate([p for _, p in ready], [r.params for r, _ in ready], use_tqdm=False)
            return [(request, output) for (request, _), output in zip(ready, outputs)]
        except ValueError as e:  # generate names the prompt it refuses before running any: drop it, run the rest
            refused = re.match(r"prompt (\d+): (.*)", str(e), re.S)
            if refused is None:
                raise
            request, _ = ready.pop(int(refused[1]))
            report(error_line(request.line, request.custom_id, refused[2]))
    return []


def _custom_id(text: str) -> str | None:
    try:
        custom_id = json.loads(text).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return custom_id if isinstance(custom_id, str) else None
