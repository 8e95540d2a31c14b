"""Qwen3-MoE and Qwen2-MoE against HF transformers on tiny random configs that cover what the real configs use: top-k
> 1 with and without renormalisation, an odd expert count, dense layers by mlp_only_layers and decoder_sparse_step,
q/k norms; checkpoints with a tensor an expert (as HF writes them) and with stacked 3-D expert tensors. The
sorted-experts path against the per-expert reference; on the GPU the fused kernels in CUDA graphs; bad checkpoints
name the tensor."""
import shutil

import pytest
import torch
from helpers import assert_greedy_matches_hf, hf_greedy, prompt_logprob_gap, save_tiny_hf
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.layers.fused_moe import moe_per_expert, moe_sorted, route_top_k

CONFIGS = {
    "top2-renormalized-mlp-only-layer": dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                                             mlp_only_layers=[1], decoder_sparse_step=1),
    "top3-raw-sparse-step-2": dict(num_experts=7, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[],
                                   decoder_sparse_step=2),
}


def write_hf_moe(tmp_path, tokenizer_dir, vocab_size: int = 512, **moe) -> str:
    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2, **moe)
    return save_tiny_hf(Qwen3MoeForCausalLM, config, tmp_path / "moe", tokenizer_dir)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_and_logprobs_match_hf(tmp_path, tiny_model_dir, name):
    path = write_hf_moe(tmp_path, tiny_model_dir("tiny-qwen3"), **CONFIGS[name])
    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.model_runner.plan.graphs_off == "not on CUDA"
    g = torch.Generator().manual_seed(1)
    assert_greedy_matches_hf(llm, hf, [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 37, 80)], 16)


def test_stacked_expert_tensors_load_as_per_expert_ones(tmp_path, tiny_model_dir):
    """The same checkpoint with each layer's experts stacked ([E, 2I, H] gate_up_proj, [E, H, I] down_proj, as
    transformers 5 holds them in memory) gives the same tokens."""
    path = write_hf_moe(tmp_path, tiny_model_dir("tiny-qwen3"), **CONFIGS["top2-renormalized-mlp-only-layer"])
    stacked_dir = tmp_path / "stacked"
    shutil.copytree(path, stacked_dir)
    [file] = stacked_dir.glob("*.safetensors")
    tensors = load_file(file)
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts."
        experts = range(5)
        gate_up = torch.stack([torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
                               for e in experts])
        down = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in experts])
        tensors[p + "gate_up_proj"], tensors[p + "down_proj"] = gate_up, down
    save_file(tensors, file, metadata={"format": "pt"})
    (stacked_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert LLM(str(stacked_dir), **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        LLM(path, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (16, 2), (64, 3)])
def test_sorted_experts_equal_the_per_expert_reference(tokens, top_k):
    g = torch.Generator().manual_seed(tokens)
    x, w13, w2 = torch.randn(tokens, 16, generator=g), torch.randn(5, 24, 16, generator=g), torch.randn(5, 16, 12, generator=g)
    weights, ids = route_top_k(torch.randn(tokens, 5, generator=g), top_k, renormalize=True)
    torch.testing.assert_close(moe_sorted(x, w13, w2, weights, ids), moe_per_expert(x, w13, w2, weights, ids),
                               atol=1e-4, rtol=1e-5)  # the sums of k experts in another order
    assert torch.allclose(weights.sum(-1), torch.ones(tokens))


def test_a_missing_or_misshapen_expert_tensor_is_named(tmp_path, tiny_model_dir):
    path = write_hf_moe(tmp_path, tiny_model_dir("tiny-qwen3"), **CONFIGS["top2-renormalized-mlp-only-layer"])
    [file] = tmp_path.joinpath("moe").glob("*.safetensors")
    tensors = load_file(file)
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    broken = dict(tensors)
    broken["model.layers.0.mlp.experts.3.up_proj.weight"] = torch.zeros(31, 64)
    save_file(broken, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"expert tensor up_proj \(expert 3\) has shape \(31, 64\), expected \(32, 64\)"):
        LLM(path, **kw)
    del tensors["model.layers.2.mlp.experts.4.down_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 expert tensors of layer 2, e.g. \['expert 4 down_proj'\]"):
        LLM(path, **kw)


def test_synthetic_and_dummy_moe_weights_give_the_same_tokens(tmp_path):
    """The synthetic writer covers Qwen3-MoE shapes (qwen3-30b-a3b: 30.5B parameters, 128 experts a layer), and
    load_format="dummy" draws what it writes."""
    import math

    from nanovllm.weights.synthetic import _BASE, SHAPES, weight_shapes, write_config, write_model

    shapes = weight_shapes({**_BASE, **SHAPES["qwen3-30b-a3b"]})
    assert round(sum(math.prod(s) for s in shapes.values()) / 1e9, 1) == 30.5
    assert "model.layers.47.mlp.experts.127.down_proj.weight" in shapes
    written = write_model("tiny-qwen3-moe", tmp_path / "written", torch.float32, device="cpu")
    config_only = write_config("tiny-qwen3-moe", tmp_path / "dummy", torch.float32)[0]
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    prompt, params = {"prompt_token_ids": list(range(3, 30))}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert LLM(str(written), **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        LLM(str(config_only), load_format="dummy", **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}


def write_qwen3moe_gguf(model: Qwen3MoeForCausalLM, path, donor: str, expert_type: str = "F32"):
    """The model as llama.cpp's converter writes a qwen3moe file: F32 tensors under GGUF names, each layer's experts
    stacked ([experts, rows, cols]) in expert_type, the tokenizer the donor's."""
    import gguf
    from gguf.quants import quantize

    c, writer = model.config, gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in ((writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, 1024),
                       (writer.add_embedding_length, c.hidden_size), (writer.add_feed_forward_length, c.intermediate_size),
                       (writer.add_head_count, c.num_attention_heads), (writer.add_head_count_kv, c.num_key_value_heads),
                       (writer.add_key_length, c.head_dim), (writer.add_value_length, c.head_dim),
                       (writer.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (writer.add_layer_norm_rms_eps, c.rms_norm_eps), (writer.add_vocab_size, c.vocab_size),
                       (writer.add_expert_count, c.num_experts), (writer.add_expert_used_count, c.num_experts_per_tok),
                       (writer.add_expert_feed_forward_length, c.moe_intermediate_size)):
        add(value)
    for key, field in gguf.GGUFReader(donor).fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    tensors = model.state_dict()
    experts = {}
    for name, tensor in tensors.items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                         "lm_head.weight": "output"}[name] + ".weight"
        elif ".experts." in name:
            layer = name.split(".")[2]
            experts.setdefault(layer, {})[name.split(".")[-1]] = tensor
            continue
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        writer.add_tensor(gguf_name, tensor.float().numpy())
    for layer, stacked in experts.items():  # transformers 5 holds them stacked: gate_up_proj [E, 2I, H], down_proj
        gate, up = stacked["gate_up_proj"].float().chunk(2, dim=1)
        for gguf_name, tensor in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", stacked["down_proj"])):
            values = tensor.float().contiguous().numpy()
            if expert_type == "F32":
                writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", values)
            else:
                kind = gguf.GGMLQuantizationType[expert_type]
                writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow  # the bundled model's tokenizer
def test_a_qwen3moe_gguf_file_gives_the_checkpoint_tokens(tmp_path, tiny_model_dir, smollm2_path):
    """The same weights as a qwen3moe GGUF file (F32, experts stacked as llama.cpp stores them) and as the HF
    checkpoint: the same greedy tokens and logprobs."""
    import gguf

    vocab = len(gguf.GGUFReader(smollm2_path).fields["tokenizer.ggml.tokens"].data)
    path = write_hf_moe(tmp_path, tiny_model_dir("tiny-qwen3"), vocab_size=vocab,
                        **CONFIGS["top2-renormalized-mlp-only-layer"])
    gguf_path = tmp_path / "moe.gguf"
    write_qwen3moe_gguf(Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32), gguf_path, smollm2_path)
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(300, 340))}, {"prompt_token_ids": [5, 9, 12]}]
    want = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    got = LLM(str(gguf_path), **kw).generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)


@pytest.mark.slow  # the bundled model's tokenizer
def test_gguf_experts_kept_quantized_on_cpu_give_the_dequantized_tokens(tmp_path, tiny_model_dir, smollm2_path):
    """Q8_0 experts: quantization="gguf" on CPU keeps them as blocks and dequantizes the routed ones a step (no dense
    copy of the experts is made); the default dequantizes them all at load. The same tokens."""
    import gguf

    vocab = len(gguf.GGUFReader(smollm2_path).fields["tokenizer.ggml.tokens"].data)
    path = write_hf_moe(tmp_path, tiny_model_dir("tiny-qwen3"), vocab_size=vocab,
                        **CONFIGS["top2-renormalized-mlp-only-layer"])
    gguf_path = tmp_path / "moe-q8.gguf"
    write_qwen3moe_gguf(Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32), gguf_path, smollm2_path, "Q8_0")
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(300, 340))}, {"prompt_token_ids": [5, 9, 12]}]
    kept = LLM(str(gguf_path), quantization="gguf", **kw)
    experts = kept.llm_engine.model_runner.model.model.layers[0].mlp.experts
    assert experts.quantized is not None and experts.w13 is None
    assert experts.quantized.parts["gate_proj"].type_name == "Q8_0"
    want = LLM(str(gguf_path), **kw).generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, kept.generate(prompts, params, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_qwen3moe_gguf_file_on_the_gpu_gives_the_cpu_tokens(tmp_path, tiny_model_dir):
    """Q8_0 experts dequantized at load for the fused kernels, the rest through the GGUF linear method, fp32: the
    CPU run's tokens. The tokenizer donor: NANOVLLM_TOKENIZER_GGUF on the device (no bundled model there)."""
    import os

    import gguf

    from nanovllm.weights.bundled import bundled_model_path

    donor = os.environ.get("NANOVLLM_TOKENIZER_GGUF") or bundled_model_path()
    vocab = len(gguf.GGUFReader(donor).fields["tokenizer.ggml.tokens"].data)
    path = write_hf_moe(tmp_path, tiny_model_dir("tiny-qwen3"), vocab_size=vocab,
                        **CONFIGS["top2-renormalized-mlp-only-layer"])
    gguf_path = tmp_path / "moe-q8.gguf"
    write_qwen3moe_gguf(Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32), gguf_path, donor, "Q8_0")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(300, 340))}, {"prompt_token_ids": [5, 9, 12]}]
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    want = LLM(str(gguf_path), device="cpu", **kw).generate(prompts, params, use_tqdm=False)
    got = LLM(str(gguf_path), device="cuda", **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_the_active_weight_bound_counts_the_routed_experts(tmp_path, tiny_model_dir):
    """bs=1 reads k of a layer's E experts (2 of 5 here); a large batch reaches nearly all; without a batch, all."""
    from nanovllm.utils.benchmarking import weight_bytes_per_step

    path = write_hf_moe(tmp_path, tiny_model_dir("tiny-qwen3"), **CONFIGS["top2-renormalized-mlp-only-layer"])
    model = LLM(path, device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20).llm_engine.model_runner.model
    experts = sum(p.numel() * 4 for name, p in model.named_parameters() if ".experts." in name)
    everything = weight_bytes_per_step(model)
    assert weight_bytes_per_step(model, batch=1) == pytest.approx(everything - experts * 3 / 5, abs=16)
    assert weight_bytes_per_step(model, batch=256) == pytest.approx(everything, rel=1e-6)


def test_qwen2_moe_with_its_shared_expert_matches_hf(tmp_path, tiny_model_dir):
    """Qwen2-MoE: q/k/v bias, top-4 of 7 experts without renormalisation, a shared expert behind a sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=7, num_experts_per_tok=4, norm_topk_prob=False,
                            max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():  # spread the routers and the shared gate from HF's near-zero init
        for name, param in hf.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "bias")):
                param.normal_(0, 0.5)
    path = tmp_path / "qwen2-moe"
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_dir('tiny-qwen3')}/{name}", path / name)
    llm = LLM(str(path), device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=1)
    for prompt in ([5, 17, 300, 41], list(range(100, 160))):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        tokens, step_logprobs = hf_greedy(hf, prompt, 12)
        assert out.token_ids == tokens
        for entry, ref, token in zip(out.logprobs, step_logprobs, tokens):
            assert abs(entry[token].logprob - ref[token].item()) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CONFIGS)
def test_fused_experts_in_cuda_graphs_match_hf(tmp_path, tiny_model_dir, name):
    """fp32 on the GPU: the fused MoE kernels, decode steps replayed from CUDA graphs, HF's greedy tokens."""
    path = write_hf_moe(tmp_path, tiny_model_dir("tiny-qwen3"), **CONFIGS[name])
    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
              kv_cache_memory_bytes=16 << 20)
    runner = llm.llm_engine.model_runner
    assert runner.graphs is not None and runner.plan.fast_kernels
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 37, 80)]
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16)[0]
    assert runner.graphs.replays > 0


def test_a_synthetic_qwen3moe_gguf_file_loads_its_experts(tmp_path):
    """synthetic_gguf writes qwen3moe files (stacked experts, an F32 router, the expert metadata) that load as
    Qwen3-MoE: the experts kept in their Q4_K blocks (CPU twin) score the prompt as the file dequantized does."""
    from nanovllm.weights.synthetic import SHAPES
    from nanovllm.weights.synthetic_gguf import write_gguf

    shape = dict(SHAPES["tiny-qwen3-moe"], hidden_size=256, moe_intermediate_size=256, mlp_only_layers=[],
                 head_dim=64)
    path = str(write_gguf(shape, "Q4_K", str(tmp_path / "moe-q4_k.gguf")))
    runs = {}
    for q in ("gguf", "none"):
        runs[q] = LLM(path, device="cpu", quantization=q, max_model_len=256, kv_cache_memory_bytes=16 << 20)
        experts = runs[q].llm_engine.model_runner.model.model.layers[0].mlp.experts
        assert experts.num_experts == 5 and (experts.quantized is not None) == (q == "gguf")
    gap = prompt_logprob_gap(runs["gguf"], runs["none"], list(range(3, 40)))
    assert gap < 0.1, gap  # bf16 linears on CPU's kept path
