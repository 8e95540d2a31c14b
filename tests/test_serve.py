"""`nanovllm serve` (entrypoints/openai/server.py) through the `openai` client on a tiny model: completions and chat,
streamed and not, the models list, the API key, bad fields, concurrent requests batched together with the tokens
LLM.generate gives them, and a stream dropped mid-way that frees its blocks. The server's engine runs in a process
of its own (as `nanovllm serve` runs it); the reference LLM runs here."""
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.openai.engine_client import EngineClient
from nanovllm.entrypoints.openai.server import build_app

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    settings = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    llm = LLM(tiny_model_dir("tiny-llama"), **settings)
    engine = EngineClient(tiny_model_dir("tiny-llama"), settings)
    server, url = _start(build_app(engine, "tiny", api_key=KEY))
    yield llm, url, engine
    server.should_exit = True
    engine.close()


def _start(app) -> tuple[uvicorn.Server, str]:
    """app served on a free port of 127.0.0.1 from a thread, once it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)


def _greedy(llm, prompts: list[str], max_tokens: int) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_completions_streamed_and_not_give_generates_text(server, client):
    llm, _, _ = server
    want = _greedy(llm, ["t5 t9 t12"], 12)[0]
    got = client.completions.create(model="tiny", prompt="t5 t9 t12", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny", prompt="t5 t9 t12", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_streamed_and_not(server, client):
    llm, _, _ = server
    messages = [{"role": "user", "content": "t7 t8"}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                    use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_concurrent_requests_share_batches_with_generates_tokens(server, client):
    """8 requests at once from 8 threads: the engine runs them in shared steps, each gets LLM.generate's text."""
    llm, _, engine = server
    prompts = [" ".join(f"t{3 + (7 * i + j) % 500}" for j in range(5 + 3 * i)) for i in range(8)]
    want = _greedy(llm, prompts, 16)
    got = [None] * len(prompts)

    def ask(i):
        got[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert engine.stats()["max_batch"] > 1  # requests ran in shared steps, not one after another


def test_models_key_and_errors(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[1] + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="t5", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt="t5", best_of=2)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt=" ".join(["t5"] * 300))
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="t5")
    assert httpx.get(server[1] + "/health").status_code == 200  # no key needed


def test_a_dropped_stream_aborts_its_request(server):
    _, url, engine = server
    with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": "t5 t6", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk in, then the client goes away
    deadline = time.monotonic() + 10
    while (stats := engine.stats())["unfinished"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stats["unfinished"] and stats["free_blocks"] == stats["num_blocks"]


def _ollama(url: str, route: str, body: dict, stream: bool = False):
    headers = {"Authorization": f"Bearer {KEY}"}
    if not stream:
        return httpx.post(url + route, json={**body, "stream": False}, headers=headers, timeout=60)
    with httpx.stream("POST", url + route, json=body, headers=headers, timeout=60) as response:
        return response.status_code, [json.loads(line) for line in response.iter_lines() if line]


def test_ollama_generate_and_chat_streamed_and_not(server):
    """Ollama's routes: NDJSON lines whose text adds up to generate's, a final line with the counts; one JSON object
    with stream false; options as SamplingParams; tags and show; errors as {"error"}."""
    llm, url, _ = server
    options = {"num_predict": 12, "temperature": 0}
    want = llm.generate("t5 t9 t12", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    whole = _ollama(url, "/api/generate", {"model": "tiny", "prompt": "t5 t9 t12", "options": options}).json()
    assert whole["response"] == want.text and whole["done"] and whole["eval_count"] == len(want.token_ids)
    status, lines = _ollama(url, "/api/generate", {"model": "tiny", "prompt": "t5 t9 t12", "options": options},
                            stream=True)
    assert status == 200 and lines[-1]["done"] and not any(line["done"] for line in lines[:-1])
    assert "".join(line["response"] for line in lines) == want.text
    assert lines[-1]["done_reason"] == ("length" if want.finish_reason == "length" else "stop")
    messages = [{"role": "user", "content": "t7 t8"}]
    chat_want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    status, lines = _ollama(url, "/api/chat", {"model": "tiny", "messages": messages, "options": options}, stream=True)
    assert "".join(line["message"]["content"] for line in lines) == chat_want
    assert [m["name"] for m in httpx.get(url + "/api/tags", headers={"Authorization": f"Bearer {KEY}"}).json()["models"]] \
        == ["tiny"]
    assert _ollama(url, "/api/show", {"model": "tiny"}).json()["model_info"]["context_length"] == 256
    bad = _ollama(url, "/api/generate", {"model": "tiny", "prompt": "t5", "options": {"mirostat": 1}})
    assert bad.status_code == 400 and "mirostat" in bad.json()["error"]
    assert _ollama(url, "/api/generate", {"model": "other", "prompt": "t5"}).status_code == 404
    assert httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "t5"}).status_code == 401


def test_generate_and_chat_commands_print_what_the_engine_samples(tiny_model_dir, capsys, monkeypatch):
    """`nanovllm generate` prints generate's text; `nanovllm chat` answers each line through the chat template, the
    conversation growing, until an empty line."""
    import io

    from nanovllm.entrypoints import cli

    path = tiny_model_dir("tiny-llama")
    flags = ["--temperature", "0", "--max-tokens", "8", "--device", "cpu", "--max-model-len", "256",
             "--kv-cache-memory-bytes", str(16 << 20)]
    llm = LLM(path, device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=8)
    want = llm.generate("t5 t9", params, use_tqdm=False)[0].outputs[0].text
    capsys.readouterr()
    assert cli.main(["generate", path, "t5 t9", *flags]) == 0
    assert capsys.readouterr().out.strip() == want.strip()
    first = llm.chat([{"role": "user", "content": "t7"}], params, use_tqdm=False)[0].outputs[0].text
    second = llm.chat([{"role": "user", "content": "t7"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "t8 t9"}], params, use_tqdm=False)[0].outputs[0].text
    monkeypatch.setattr("sys.stdin", io.StringIO("t7\nt8 t9\n\nt10\n"))
    capsys.readouterr()
    assert cli.main(["chat", path, *flags]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [first, second]


def test_logprobs_as_openai_gives_them(server, client):
    """Chat (logprobs, top_logprobs) and completions (logprobs = n): each sampled token's logprob as generate gives
    it, the alternatives ranked; streamed, each chunk carries its new tokens'."""
    llm, _, _ = server
    want = llm.generate("t5 t9", SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt="t5 t9", max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert got.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(want.logprobs, want.token_ids)])
    assert all(len(top) == 2 and max(top.values()) >= lp for top, lp in zip(got.top_logprobs, got.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t7"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    streamed = list(client.completions.create(model="tiny", prompt="t5 t9", max_tokens=5, temperature=0, logprobs=2,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert [lp for c in streamed for lp in c.choices[0].logprobs.token_logprobs] == pytest.approx(got.token_logprobs)


def test_an_engine_that_dies_is_an_error_not_a_hang(tiny_model_dir):
    """The engine process killed mid-stream: the stream ends with an error and the next request gets a 503 at
    once; an engine that cannot start says why."""
    engine = EngineClient(tiny_model_dir("tiny-llama"), dict(device="cpu", max_model_len=256,
                                                             kv_cache_memory_bytes=16 << 20))
    server, url = _start(build_app(engine, "tiny"))
    url += "/v1/completions"
    body = {"model": "tiny", "prompt": "t5 t6", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        engine.process.kill()
        rest = list(lines)
    assert any('"error"' in line for line in rest)
    late = httpx.post(url, json={**body, "stream": False}, timeout=30)
    assert late.status_code == 503 and "engine process" in late.json()["error"]["message"]
    server.should_exit = True
    with pytest.raises(RuntimeError, match="the engine did not start"):
        EngineClient("/no/such/model", dict(device="cpu"))
