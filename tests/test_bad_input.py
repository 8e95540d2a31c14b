"""Bad input: a clear error naming the problem, raised before any work, and the engine still usable."""
import json
import shutil

import pytest
from conftest import assert_no_leaks

from nanovllm import LLM, SamplingParams

OK = {"prompt_token_ids": [5, 6, 7]}


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("max_tokens", 0),
    ("min_tokens", -1), ("logprobs", -1), ("prompt_logprobs", -3), ("stop", [""]), ("stop_token_ids", [-1]),
    ("seed", 1.5),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


@pytest.mark.parametrize("prompt,message", [
    ({"prompt_token_ids": []}, "empty"),
    ("", "empty"),
    ({"prompt_token_ids": [5, 512]}, r"\[0, 512\)"),
    ({"prompt_token_ids": [-1, 5]}, r"\[0, 512\)"),
    ({"prompt_token_ids": [5] * 513}, "max_model_len=512"),
])
def test_bad_prompts_fail_before_work_and_engine_survives(tiny_llm, prompt, message):
    steps_before = tiny_llm.llm_engine.scheduler.num_preemptions
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate([OK, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()  # nothing of the batch was queued
    assert_no_leaks(tiny_llm)
    assert tiny_llm.llm_engine.scheduler.num_preemptions == steps_before
    out = tiny_llm.generate(OK, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_stop_token_id_outside_vocab(tiny_llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        tiny_llm.generate(OK, SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)


@pytest.mark.parametrize("prompts,message", [
    ([OK, 42], "prompt 1: a prompt is a str"), (None, "generate\\(\\) needs prompts: a prompt is a str"),
    (42, "prompts must be a prompt or a list"), ([{"text": OK}], "prompt 0: a prompt is a str"),
])
def test_bad_prompt_type(tiny_llm, prompts, message):
    with pytest.raises(TypeError, match=message):
        tiny_llm.generate(prompts, use_tqdm=False)


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    model = tmp_path / "gpt2"
    shutil.copytree(tiny_model_dir("tiny-llama"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture.*LlamaForCausalLM"):
        LLM(str(model))


def test_a_load_format_that_does_not_fit_the_model_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, gguf, dummy, got 'pt'"):
        LLM(tiny_model_dir("tiny-llama"), load_format="pt")
    with pytest.raises(ValueError, match="load_format='gguf' does not fit"):
        LLM(tiny_model_dir("tiny-llama"), load_format="gguf")
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="load_format='dummy' does not fit"):
        LLM(str(gguf_file), load_format="dummy")


def test_corrupt_and_truncated_safetensors(tiny_model_dir, tmp_path):
    for name, mangle in [("truncated", lambda b: b[: len(b) // 2]), ("corrupt", lambda b: b"\x00\xff" * 64)]:
        model = tmp_path / name
        shutil.copytree(tiny_model_dir("tiny-llama"), model)
        shard = next(model.glob("*.safetensors"))
        shard.write_bytes(mangle(shard.read_bytes()))
        with pytest.raises(ValueError, match="corrupt or truncated safetensors"):
            LLM(str(model), max_model_len=64)


def test_corrupt_and_truncated_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x07" * 100)
    with pytest.raises(ValueError, match="corrupt or truncated GGUF"):
        LLM(str(bad))
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(str(not_gguf))


def _write_gguf(path, tensor_type, truncate=False):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    bs, nb = gguf.GGML_QUANT_SIZES[tensor_type]
    w.add_tensor("token_embd.weight", np.zeros((8, 2 * nb), np.uint8), raw_dtype=tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[:-16])


def test_gguf_unsupported_tensor_type_and_truncation(tmp_path):
    from gguf import GGMLQuantizationType as T

    _write_gguf(tmp_path / "q81.gguf", T.Q8_1)
    with pytest.raises(ValueError, match="unsupported GGUF tensor type Q8_1"):
        LLM(str(tmp_path / "q81.gguf"))
    _write_gguf(tmp_path / "cut.gguf", T.Q8_0, truncate=True)
    with pytest.raises(ValueError, match="truncated GGUF"):
        LLM(str(tmp_path / "cut.gguf"))


def test_kv_budget_too_small_says_what_to_raise(tiny_model_dir):
    with pytest.raises(ValueError, match="raise kv_cache_memory_bytes"):
        LLM(tiny_model_dir("tiny-llama"), max_model_len=1024, kv_cache_memory_bytes=1 << 16)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_model_len=10**6), "max_model_len"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(block_size=3), "block_size"), (dict(dtype="int8"), "dtype"), (dict(device="tpu"), "device"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens"),
    (dict(attention_backend="magic"), "attention_backend"),
])
def test_bad_engine_arguments(tiny_model_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_model_dir("tiny-llama"), **kwargs)


def test_a_failed_download_of_the_bundled_model_says_what_to_do(tmp_path, monkeypatch):
    import subprocess

    import nanovllm.weights.bundled as bundled

    def no_network(command, **kwargs):
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(bundled, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(subprocess, "run", no_network)
    with pytest.raises(bundled.BundledModelUnavailable, match=f"put {bundled.FILE_NAME} in {tmp_path}"):
        bundled.bundled_model_path()


def test_weights_that_run_the_device_out_of_memory_say_what_makes_room(tmp_path, monkeypatch):
    """A 70B-class config (weights drawn at load, so nothing is read): running out of memory while building is an
    error that gives the model's size and the settings that make room, before anything else starts."""
    import torch

    from nanovllm.engine import model_loader
    from nanovllm.weights.synthetic import write_config

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.96 GiB")

    monkeypatch.setattr(model_loader, "_build", out_of_memory)
    path = str(write_config("llama3-70b", tmp_path, torch.bfloat16)[0])
    with pytest.raises(torch.OutOfMemoryError, match=r"70\.6B parameters: 131\.4 GiB at bfloat16 .*cpu_offload_gb"):
        LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=256)


@pytest.mark.parametrize("message", [{"content": "hi"}, {"role": "user"}, {"role": 3, "content": "hi"}, "hi"])
def test_a_chat_message_without_role_or_content_names_it(tiny_llm, message):
    with pytest.raises(ValueError, match=r"chat message 1 must be a dict with a 'role' string and 'content'"):
        tiny_llm.chat([{"role": "user", "content": "hello"}, message], use_tqdm=False)
    assert_no_leaks(tiny_llm)
