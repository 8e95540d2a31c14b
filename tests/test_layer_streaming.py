"""Decoder layers streamed from host memory and disk (cpu_offload_gb, disk_offload_gb; nanovllm/streaming): the
placement plan, the disk file, the slot cache's choice, and streamed models generating the tokens and logprobs of
the same model held resident. On CPU the
slots are host tensors; on CUDA (where there is one) the host buffers are pinned and copies cross the link."""
import os

import pytest
import torch
from torch import nn

from nanovllm import LLM, SamplingParams
from nanovllm.streaming.layer_file import LayerFile, aligned
from nanovllm.streaming.layer_streamer import LayerStreamer
from nanovllm.streaming.placement import plan_placement
from nanovllm.weights.synthetic import SHAPES, write_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# a small KV cache: on a GPU the engines of a test live side by side, and one of 90% of the memory leaves the next none
ENGINE = dict(device=DEVICE, max_model_len=128, kv_cache_memory_bytes=64 << 20)


def test_the_streamed_layers_are_spread_evenly_among_the_resident_ones():
    """Evenly spaced, so the link loads each streamed layer while the resident ones before it compute."""
    assert plan_placement([10, 10, 10, 10], 15).streamed == [0, 2]
    assert plan_placement([10] * 32, 80).streamed == list(range(0, 32, 4))
    both = plan_placement([10] * 80, 400, 90)  # 70B-class: 49 of 80 streamed, 9 of them from disk
    assert len(both.disk) == 9 and len(both.host) == 40 and not set(both.disk) & set(both.host)
    assert max(b - a for a, b in zip(both.streamed, both.streamed[1:] + [80])) == 2
    assert max(b - a for a, b in zip(both.disk, both.disk[1:])) <= 10
    assert "| disk | 9 |" in both.table()
    assert plan_placement([10, 10, 10, 10], 0).streamed == []
    assert plan_placement([10, 10, 10, 10], 100).streamed == [0, 1, 2, 3]
    uneven = plan_placement([10, 20] * 8, 100, 50)  # at least each budget, whatever the layers' sizes
    assert uneven.bytes_of(uneven.host) >= 100 and uneven.bytes_of(uneven.disk) >= 50
    table = plan_placement([1 << 30] * 4, 1 << 30).table(host_to_device_bandwidth=2 << 30)
    assert "| device | 3 | 3.00 GiB |" in table and "| host memory | 1 | 1.00 GiB |" in table
    assert "500.0 ms a step" in table
    with pytest.raises(ValueError, match="cpu_offload_gb must be >= 0"):
        plan_placement([10], -1)


def test_the_layer_file_gives_back_what_was_written(tmp_path):
    layer_file = LayerFile(str(tmp_path))
    blobs = {i: torch.randint(0, 256, (n,), dtype=torch.uint8) for i, n in ((3, 5000), (7, 4096), (1, 1))}
    for i, blob in blobs.items():
        layer_file.write(i, blob)
    assert layer_file.size == 3 * 4096 + 4096 and os.path.getsize(layer_file.path) == layer_file.size
    for i, blob in blobs.items():
        out = torch.zeros(aligned(blob.numel()) + 4096, dtype=torch.uint8)
        layer_file.read_into(i, out[1:])  # a buffer off the page boundary too
        assert torch.equal(out[1:1 + blob.numel()], blob)


def test_a_slot_gives_way_to_the_layer_needed_soonest():
    layers = [nn.Linear(4, 4) for _ in range(5)]
    streamer = LayerStreamer(layers, [0, 1, 2, 3, 4], torch.device("cpu"), num_slots=3)
    x = torch.randn(1, 4)
    for layer in layers:
        layer(x)
    # once the last layer's work is launched, the next step's first three load
    assert sorted(streamer.slot_of) == [0, 1, 2]
    loads = streamer.num_loads
    layers[0](x)
    assert streamer.num_loads == loads + 1  # 0 was there; 3 comes in, in place of 0 (now needed last)
    assert sorted(streamer.slot_of) == [1, 2, 3]


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory) -> str:
    shape = dict(SHAPES["tiny-qwen3"], num_hidden_layers=6)
    return str(write_model(shape, tmp_path_factory.mktemp("six"), torch.float32, device="cpu"))


def test_a_streamed_model_generates_as_the_resident_one(six_layers, tmp_path):
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    resident = LLM(six_layers, dtype="float32", **ENGINE)
    layer_bytes = sum(p.numel() * p.element_size() for p in resident.llm_engine.model_runner.model.model.layers[0]
                      .parameters())
    want = [o.outputs[0] for o in resident.generate(prompts, params, use_tqdm=False)]
    streamed = LLM(six_layers, dtype="float32", **ENGINE,
                   cpu_offload_gb=4 * layer_bytes / (1 << 30))
    streamer = streamed.llm_engine.model_runner.streamer
    assert streamer.streamed == [0, 1, 3, 4] and streamer.num_slots == 2  # spread among the resident 2 and 5
    assert all(buffer.is_pinned() == (DEVICE == "cuda") for buffer in streamer.host.values())
    loads = streamer.num_loads
    got = [o.outputs[0] for o in streamed.generate(prompts, params, use_tqdm=False)]
    assert streamer.num_loads - loads >= 4 * 16  # 4 layers through 2 slots: every step copies each
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, rel=1e-5, abs=1e-5)
    on_disk = LLM(six_layers, dtype="float32", **ENGINE, offload_folder=str(tmp_path),
                  disk_offload_gb=2 * layer_bytes / (1 << 30), cpu_offload_gb=layer_bytes / (1 << 30))
    streamer = on_disk.llm_engine.model_runner.streamer
    assert streamer.streamed == [0, 2, 4] and streamer.disk == {0, 2} and sorted(streamer.host) == [4]
    assert os.path.dirname(streamer.layer_file.path) == str(tmp_path)
    got = [o.outputs[0] for o in on_disk.generate(prompts, params, use_tqdm=False)]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(cpu_offload_gb=-1), "cpu_offload_gb must be >= 0"),
    (dict(disk_offload_gb=-1), "disk_offload_gb must be >= 0"),
])
def test_bad_offload_settings_name_the_problem(six_layers, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(six_layers, device="cpu", **kwargs)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_layers_stream_their_quantized_bytes(tmp_path, quantization):
    """int4 layers stream their INT4_G128 fields, int8 ones their int8 weights and scales (under a fifth / a third of
    the fp32 projections' bytes), and give the tokens of the quantized model held resident."""
    shape = dict(SHAPES["tiny-llama-128"], num_hidden_layers=4)
    path = str(write_model(shape, tmp_path, torch.float32, device="cpu"))
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    kw = dict(dtype="float32" if DEVICE == "cpu" else "float16", quantization=quantization, **ENGINE)
    resident = LLM(path, **kw)
    want = [o.outputs[0] for o in resident.generate(prompts, params, use_tqdm=False)]
    streamed = LLM(path, cpu_offload_gb=1, **kw)  # every layer
    streamer = streamed.llm_engine.model_runner.streamer
    h, ff, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"] * 32  # head_dim 32
    dense_bytes = 4 * (h * (2 * h + 2 * kv) + 3 * h * ff)  # a layer's projections in fp32
    assert streamer.streamed == [0, 1, 2, 3] and 0 < streamer.sizes[0] < dense_bytes / (3 if quantization == "int8" else 5)
    got = [o.outputs[0] for o in streamed.generate(prompts, params, use_tqdm=False)]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(cpu_offload_gb=1), "cpu_offload_gb=1 asks for 0.00 GiB of host memory, but 0.00 GiB is available: lower it"),
    (dict(kv_offloading_size=0.5), "kv_offloading_size=0.5 asks for 0.50 GiB of host memory, but 0.00 GiB is"),
])
def test_offloading_more_than_the_host_holds_names_the_setting(six_layers, monkeypatch, kwargs, message):
    monkeypatch.setattr("nanovllm.host_memory.available_bytes", lambda: 1000)
    with pytest.raises(ValueError, match=message):
        LLM(six_layers, device="cpu", max_model_len=128, **kwargs)


@pytest.mark.parametrize("damage,error,message", [
    (lambda path: os.truncate(path, 4096), OSError, "cut short"),
    (os.remove, FileNotFoundError, "is gone"),
])
def test_a_damaged_layer_file_is_a_clear_error(six_layers, tmp_path, monkeypatch, damage, error, message):
    """The disk tier's file cut short or removed mid-run: the next read names the file and what happened."""
    if damage is os.remove:  # kvikio keeps the file open from load, and an open file removed is still read whole
        monkeypatch.setenv("NANOVLLM_KVIKIO", "0")
    llm = LLM(six_layers, dtype="float32", **ENGINE, offload_folder=str(tmp_path),
              disk_offload_gb=1e-6)
    layer_file = llm.llm_engine.model_runner.streamer.layer_file
    if layer_file.fd is not None:  # opened at load: reopen after the damage
        os.close(layer_file.fd)
        layer_file.fd = None
    damage(layer_file.path)
    with pytest.raises(error, match=message):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)


class _Future:
    def __init__(self, result):
        self.result = result

    def get(self):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("result", [RuntimeError("KvikIO failure: POSIX error on pread: EOF"), 4096])
def test_a_failed_kvikio_read_is_an_os_error_naming_the_file(result):
    """kvikio reports a read past the end as a RuntimeError (seen on the device) and a short read as a count: both
    become the OSError that names the file, as the plain reads' do."""
    from nanovllm.streaming.kvikio_reader import PendingRead

    with pytest.raises(OSError, match=r"/x/layers.bin .*offset 8192.*cut short"):
        PendingRead(_Future(result), 8192, 8192, "/x/layers.bin").wait()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kvikio_reads_what_the_plain_reads_read(tmp_path):
    """kvikio (GDS or its compatibility mode) into GPU memory against the layer file's own positional reads."""
    pytest.importorskip("kvikio")
    from nanovllm.streaming.kvikio_reader import KvikioReader

    layer_file = LayerFile(str(tmp_path))
    written = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (5000, 12288, 4096 * 3 + 7)]
    for index, buffer in enumerate(written):
        layer_file.write(index, buffer)
    reader = KvikioReader(layer_file.path)
    for index, buffer in enumerate(written):
        offset, nbytes = layer_file.places[index]
        on_gpu = torch.empty(aligned(nbytes), dtype=torch.uint8, device="cuda")
        reader.read(offset, aligned(nbytes), on_gpu).wait()
        plain = torch.empty(aligned(nbytes), dtype=torch.uint8)
        layer_file.read_into(index, plain)
        assert torch.equal(on_gpu[:nbytes].cpu(), buffer) and torch.equal(plain[:nbytes], buffer)
