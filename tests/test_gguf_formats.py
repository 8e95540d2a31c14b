"""GGUF's block formats: the table against the gguf package's sizes, and the torch dequantization (the twin of
every quantized kernel) against gguf.quants.dequantize, bit for bit, on random blocks of every type."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from helpers import random_tensor

from nanovllm.quant.gguf_formats import FORMATS, dequantize


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_table_matches_the_gguf_package(type_name):
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    assert (FORMATS[type_name].block_size, FORMATS[type_name].block_bytes) == (block_size, block_bytes)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_torch_dequantization_is_gguf_bit_for_bit(type_name):
    rng = np.random.default_rng(sum(map(ord, type_name)))
    fmt = FORMATS[type_name]
    rows, cols = 5, max(fmt.block_size, 32) * 3
    raw = random_tensor(type_name, rows, cols, rng)
    view = {"F32": np.float32, "F16": np.float16}.get(type_name)
    want = np.asarray(gguf_dequantize(raw.view(view) if view else raw, GGMLQuantizationType[type_name]),
                      dtype=np.float32).reshape(rows, cols)
    got = dequantize(torch.from_numpy(raw.copy()), type_name, cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="IQ2_XS.*Q4_K"):
        dequantize(torch.zeros(4, dtype=torch.uint8), "IQ2_XS", 256)
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        dequantize(torch.zeros(18, dtype=torch.uint8), "Q4_0", 48)


def test_a_tensor_whose_bytes_do_not_hold_its_shape_fails_at_open(tmp_path):
    """A row that is not whole blocks is refused when the file is opened (the gguf reader finds it), before any
    weight is used: a valid file whose tensor header is then edited to rows of 48 weights."""
    import struct

    from nanovllm.weights.gguf_loader import open_gguf

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raw = random_tensor("Q4_0", 2, 64, np.random.default_rng(0))
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    dims_at = data.index(b"blk.0.attn_q.weight") + len("blk.0.attn_q.weight") + 4  # past the name and n_dims
    assert struct.unpack_from("<Q", data, dims_at)[0] == 64
    struct.pack_into("<Q", data, dims_at, 48)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"corrupt or truncated GGUF file .*bad\.gguf.*\(48\).*Q4_0 block size \(32\)"):
        open_gguf(str(path))
