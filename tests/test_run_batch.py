"""`nanovllm run-batch` (entrypoints/run_batch.py): an OpenAI batch file with chat and completion requests and
malformed lines; outputs equal to LLM.chat / LLM.generate with the same parameters, errors reported by line, and a
stopped job resumed without running a finished request again."""
import json
import subprocess
import sys

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints import cli, run_batch

CHAT = "/v1/chat/completions"


def chat(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "m", "messages": [{"role": "user", "content": content}], **body}}


LINES = [
    chat("c1", "t5 t6 t7", max_tokens=8, temperature=0),
    {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "t5 t9 t12", "max_tokens": 6, "temperature": 0}},
    "not json {",
    {"custom_id": "c4", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    chat("c5", "t3", max_tokens=-1),
    chat("c1", "t8", max_tokens=4),
    {"custom_id": "c7", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": " ".join(["t5"] * 200), "max_tokens": 4}},
    chat("c8", "t3", tools=[{"type": "function"}]),
    chat("c9", "t11 t4", max_completion_tokens=5, n=2, temperature=0.8, seed=1),
]
BAD = {3: "not JSON", 4: "url '/v1/embeddings' is not served", 5: "max_tokens", 6: "custom_id repeats",
       7: "max_model_len", 8: "body fields not served: tools"}


@pytest.fixture
def batch_file(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in LINES) + "\n")
    return path


def args(model, batch_file, tmp_path, *extra):
    return ["run-batch", "-i", str(batch_file), "-o", str(tmp_path / "out.jsonl"), "--model", model, "--device", "cpu",
            "--max-model-len", "64", *extra]


def results(tmp_path, name="out.jsonl"):
    return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]


def test_outputs_are_those_of_chat_and_generate(tiny_model_dir, batch_file, tmp_path):
    model = tiny_model_dir("tiny-llama")
    assert cli.main(args(model, batch_file, tmp_path)) == 0
    out = results(tmp_path)
    assert [entry["custom_id"] for entry in out] == ["c1", "c2", "c9"]
    errors = {entry["line"]: entry for entry in results(tmp_path, "out.jsonl.errors.jsonl")}
    assert sorted(errors) == sorted(BAD)
    for line, message in BAD.items():
        assert message in errors[line]["error"]["message"] and errors[line]["response"] is None
    llm = LLM(model, device="cpu", max_model_len=64)
    want_chat = llm.chat([{"role": "user", "content": "t5 t6 t7"}], SamplingParams(max_tokens=8, temperature=0),
                         use_tqdm=False)[0]
    body = out[0]["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "m"  # the request's model, echoed
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want_chat.outputs[0].text}
    assert body["usage"]["prompt_tokens"] == len(want_chat.prompt_token_ids)
    want_text = llm.generate("t5 t9 t12", SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert out[1]["response"]["body"]["choices"][0]["text"] == want_text.outputs[0].text
    seeded = llm.chat([{"role": "user", "content": "t11 t4"}], SamplingParams(max_tokens=5, n=2, temperature=0.8,
                                                                            seed=1), use_tqdm=False)[0]
    assert [c["message"]["content"] for c in out[2]["response"]["body"]["choices"]] == \
        [c.text for c in seeded.outputs]


def test_a_stopped_job_resumes_where_it_stopped(tiny_model_dir, batch_file, tmp_path, monkeypatch):
    model = tiny_model_dir("tiny-llama")
    serve, calls, stop = run_batch.serve, [], [True]

    def stops_at_the_second_chunk(llm, chunk, report):
        calls.append([r.custom_id for r in chunk])
        if stop[0] and len(calls) == 2:
            raise RuntimeError("the job is stopped")
        return serve(llm, chunk, report)

    monkeypatch.setattr(run_batch, "serve", stops_at_the_second_chunk)
    with pytest.raises(RuntimeError, match="the job is stopped"):
        cli.main(args(model, batch_file, tmp_path, "--chunk-size", "1"))
    assert [entry["custom_id"] for entry in results(tmp_path)] == ["c1"]
    with open(tmp_path / "out.jsonl", "a") as f:
        f.write('{"id": "batch_req_2", "custom_')  # a line torn by the stop
    calls.clear()
    stop[0] = False
    assert cli.main(args(model, batch_file, tmp_path, "--chunk-size", "1")) == 0
    assert calls == [["c2"], ["c7"], ["c9"]]  # c1 is not run again (c7 is refused by the engine)
    assert [entry["custom_id"] for entry in results(tmp_path)] == ["c1", "c2", "c9"]
    assert sorted(entry["line"] for entry in results(tmp_path, "out.jsonl.errors.jsonl")) == sorted(BAD)


def test_the_command_runs_as_a_program(tiny_model_dir, batch_file, tmp_path):
    done = subprocess.run([sys.executable, "-m", "nanovllm.entrypoints.cli",
                           *args(tiny_model_dir("tiny-llama"), batch_file, tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "run-batch: 3 requests served" in done.stdout and "6 lines not served" in done.stdout
    assert len(results(tmp_path)) == 3


def test_two_data_parallel_replicas_write_what_one_engine_writes(tiny_model_dir, batch_file, tmp_path):
    model = tiny_model_dir("tiny-llama")
    for name, extra in (("one.jsonl", []), ("two.jsonl", ["--data-parallel-size", "2"])):
        assert cli.main(["run-batch", "-i", str(batch_file), "-o", str(tmp_path / name), "--model", model,
                         "--device", "cpu", "--max-model-len", "64", *extra]) == 0
    one, two = results(tmp_path, "one.jsonl"), results(tmp_path, "two.jsonl")
    for entry in one + two:
        entry["response"]["body"].pop("created")
    assert one == two and [entry["custom_id"] for entry in two] == ["c1", "c2", "c9"]


def test_weights_drawn_at_load_write_what_the_written_weights_write(tiny_model_dir, batch_file, tmp_path):
    """--load-format dummy on a config alone (a pipeline tried at a model's real shape without its weights): the
    tiny model's written weights are the drawn ones, so the results are the same."""
    from nanovllm.weights.synthetic import write_config

    config_only = str(write_config("tiny-llama", tmp_path / "config-only", torch.float32)[0])
    for name, model, extra in (("written.jsonl", tiny_model_dir("tiny-llama"), []),
                               ("drawn.jsonl", config_only, ["--load-format", "dummy", "--dtype", "float32"])):
        assert cli.main(["run-batch", "-i", str(batch_file), "-o", str(tmp_path / name), "--model", model,
                         "--device", "cpu", "--max-model-len", "64", *extra]) == 0
    written, drawn = results(tmp_path, "written.jsonl"), results(tmp_path, "drawn.jsonl")
    for entry in written + drawn:
        entry["response"]["body"].pop("created")
        entry["response"]["body"].pop("model")
    assert written == drawn and len(drawn) == 3
