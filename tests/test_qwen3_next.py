"""Qwen3-Next (hybrid: Gated DeltaNet and gated full attention, experts with a shared expert) against HF transformers
in fp32 on CPU, on tiny random configs that cover what the real config uses: layer_types alternation, grouped value
heads, partial rotary, q/k norms, top-k experts with and without renormalisation, a dense layer. Then the state
slots under the engine's bookkeeping: chunked prefill, preemption (recompute), n > 1, aborts, async scheduling."""

import pytest
import torch
from helpers import assert_greedy_matches_hf, hf_greedy, hf_prompt_logprobs, save_tiny_hf
from transformers import Qwen3NextConfig
from transformers import Qwen3NextForCausalLM as HFQwen3Next

from nanovllm import LLM, SamplingParams

CONFIGS = {
    "top2-renormalized-dense-layer": dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                                          mlp_only_layers=[1], layer_types=["linear_attention", "linear_attention",
                                                                            "full_attention", "linear_attention"]),
    "top3-raw": dict(num_experts=7, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[],
                     layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
}


def write_hf_next(tmp_path, tokenizer_dir, **overrides) -> str:
    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, decoder_sparse_step=1, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **overrides)
    return save_tiny_hf(HFQwen3Next, config, tmp_path / "next", tokenizer_dir, spread_norms=True)


@pytest.fixture(scope="module")
def next_model(tmp_path_factory, tiny_model_dir):
    return write_hf_next(tmp_path_factory.mktemp("next"), tiny_model_dir("tiny-qwen3"),
                         **CONFIGS["top2-renormalized-dense-layer"])


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_and_logprobs_match_hf(tmp_path, tiny_model_dir, name):
    path = write_hf_next(tmp_path, tiny_model_dir("tiny-qwen3"), **CONFIGS[name])
    hf = HFQwen3Next.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    prompts = _prompts((1, 5, 37, 80))  # a one-token prompt decodes from its first step, in the batched path
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=1, prompt_logprobs=1)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[::-1]], params, use_tqdm=False)  # slots used once
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in first[::-1]]
    for prompt, out in zip(prompts, outputs):
        tokens, step_logprobs = hf_greedy(hf, prompt, 12)
        assert out.outputs[0].token_ids == tokens
        for entry, ref, token in zip(out.outputs[0].logprobs, step_logprobs, tokens):
            assert abs(entry[token].logprob - ref[token].item()) < 1e-4
        ref_prompt = hf_prompt_logprobs(hf, prompt)
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            assert abs(entry[prompt[i + 1]].logprob - ref_prompt[i, prompt[i + 1]].item()) < 1e-4
    assert llm.llm_engine.block_manager.state_slots.num_free == llm.llm_engine.config.max_num_seqs


def test_state_slots_under_chunked_prefill_preemption_and_aborts(next_model):
    """Prompts split over steps, a KV cache too small for every sequence at once (preemption recomputes, state and
    all), n = 2, async scheduling on and off: the tokens of an engine with room to spare; no slot leaks."""
    prompts = [{"prompt_token_ids": p} for p in _prompts((70, 23, 51, 9, 64), seed=2)]
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, n=2)
    roomy = LLM(next_model, device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    for async_scheduling in (True, False):
        tight = LLM(next_model, device="cpu", max_model_len=128, num_gpu_blocks_override=12, block_size=16,
                    max_num_batched_tokens=32, max_num_seqs=4, async_scheduling=async_scheduling)
        engine = tight.llm_engine
        got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert engine.scheduler.num_preemptions > 0
        assert not engine.block_manager.enable_prefix_caching
        assert engine.block_manager.state_slots.num_free == 4
    engine.add_request("aborted", prompts[0]["prompt_token_ids"], SamplingParams(max_tokens=50))
    for _ in range(4):  # its prompt, then decode steps
        engine.step()
    engine.abort_request("aborted")
    assert engine.block_manager.state_slots.num_free == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_decode_graphs_and_fla_prefill_match_hf(next_model, monkeypatch):
    """fp32 on the GPU: decode steps replayed from CUDA graphs on the state slots (Triton), prompts through
    fla-core where it imports (else the torch twin), chunked prefill continuing from a state: HF's greedy tokens
    (HF on CPU through its torch functions, which it swaps for fla-core's where fla-core imports)."""
    import inspect

    import transformers.models.qwen3_next.modeling_qwen3_next as hf_module

    for name, function in vars(hf_module).copy().items():
        if ("delta_rule" in name or "conv1d" in name) and hasattr(function, "__wrapped__"):
            monkeypatch.setattr(hf_module, name, inspect.unwrap(function))
    hf = HFQwen3Next.from_pretrained(next_model, dtype=torch.float32).eval()
    for chunk in (512, 48):  # whole prompts; prompts in chunks of a step's 48 tokens
        llm = LLM(next_model, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                  kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=chunk)
        runner = llm.llm_engine.model_runner
        assert runner.graphs is not None and runner.prefill_graphs is None
        assert_greedy_matches_hf(llm, hf, _prompts((1, 5, 37, 80, 130)), 16, tol=2e-3)
        assert runner.graphs.replays > 0
        assert llm.llm_engine.block_manager.state_slots.num_free == 8


@pytest.mark.parametrize("shape", ["tiny-qwen3-next", "tiny-qwen3.5-moe"])
def test_the_synthetic_shape_and_dummy_weights_load(tiny_model_dir, shape):
    """The tiny shapes as the synthetic writer draws them (full_attention_interval, no layer_types; zero-centered
    norms): HF's greedy tokens; load_format="dummy" draws the same weights."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(shape)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = _prompts((29,), seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
    for load_format in ("auto", "dummy"):
        llm = LLM(path, device="cpu", max_model_len=128, kv_cache_memory_bytes=16 << 20, load_format=load_format)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10)[0]


def test_kv_offloaded_past_the_device_and_swap_refused(next_model):
    """KV in host memory for the attention layers (a sequence longer than the device's blocks attends to its
    offloaded ones) while the linear-attention layers keep their slots: the tokens of ample memory; preemption
    recomputes (a swap would lose the state), and asking for swaps is an error that says so."""
    prompts = [{"prompt_token_ids": p} for p in _prompts((70, 23, 51, 9, 64), seed=2)]
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    roomy = LLM(next_model, device="cpu", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(next_model, device="cpu", max_model_len=128, num_gpu_blocks_override=3, block_size=16,
                kv_offloading_size=0.01, max_num_batched_tokens=32, max_num_seqs=4)
    engine = tight.llm_engine
    assert engine.model_runner.layer_major is None and engine.model_runner.preemption.mode == "recompute"
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == want
    assert engine.block_manager.num_offloaded_blocks > 0
    with pytest.raises(ValueError, match="preemption_mode='swap'.*linear-attention"):
        LLM(next_model, device="cpu", max_model_len=128, kv_offloading_size=0.01, preemption_mode="swap")


def _write_hf_qwen3_5(tmp_path, tokenizer_dir, moe: bool) -> str:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=1024,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                   "mrope_section": [1, 1, 0], "mrope_interleaved": True},
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if moe:
        config = Qwen3_5MoeTextConfig(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
                                      num_experts_per_tok=2, **common)
        model_class = Qwen3_5MoeForCausalLM
    else:
        config, model_class = Qwen3_5TextConfig(intermediate_size=96, **common), Qwen3_5ForCausalLM
    return save_tiny_hf(model_class, config, tmp_path / "qwen3_5", tokenizer_dir, spread_norms=True), model_class


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen3_5_matches_hf(tmp_path, tiny_model_dir, moe):
    """Qwen3.5's separate q/k/v, z, b, a projections; its text rotary (mrope with equal positions) is plain rotary."""
    path, model_class = _write_hf_qwen3_5(tmp_path, tiny_model_dir("tiny-qwen3"), moe)
    hf = model_class.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert_greedy_matches_hf(llm, hf, _prompts((6, 41), seed=4), 12)


def test_a_vision_language_checkpoint_runs_its_language_model(tmp_path, tiny_model_dir):
    """Qwen3.5 as released: Qwen3_5MoeForConditionalGeneration, the text config nested, the language model's weights
    under model.language_model.*, beside a vision tower and a multi-token prediction head that are not loaded."""
    import json

    from safetensors.torch import load_file, save_file

    path, model_class = _write_hf_qwen3_5(tmp_path, tiny_model_dir("tiny-qwen3"), moe=True)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    prompt = {"prompt_token_ids": _prompts((17,), seed=5)[0]}
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    want = LLM(path, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    [file] = list((tmp_path / "qwen3_5").glob("*.safetensors"))
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in load_file(file).items()}
    tensors.update({"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(2, 2)})
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = tmp_path / "qwen3_5" / "config.json"
    text = json.loads(config_file.read_text())
    json.dump({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": {**text, "model_type": "qwen3_5_moe_text"}}, open(config_file, "w"))
    llm = LLM(path, **kw)
    assert type(llm.llm_engine.model_runner.model).__name__ == "Qwen3_5ForCausalLM"
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want


def _tiled(t: torch.Tensor, dim: int, hk: int, per_k: int, head_dim: int) -> torch.Tensor:
    """Value heads from grouped by key head to tiled, as llama.cpp's converter stores Qwen3.5's."""
    shape = list(t.shape)
    return t.reshape(*shape[:dim], hk, per_k, head_dim, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def write_hybrid_gguf(model, path, expert_type: str | None = None):
    """A Qwen3-Next or Qwen3.5 checkpoint as llama.cpp's converter writes it (conversion/qwen.py: Qwen3NextModel,
    Qwen3_5TextModel, Qwen3_5MoeTextModel; checked tensor by tensor against that converter's own output of the same
    checkpoints on 2026-11-28): Qwen3-Next's q, k, v de-interleaved into attn_qkv and z into attn_gate, Qwen3.5's
    value heads tiled, ssm_a = -exp(A_log), ssm_dt.bias, the conv1d squeezed, zero-centered norms stored as 1 + w.
    F32 throughout but the routed experts where expert_type names a block type (gguf-py quantizes them, and the
    model's experts become the blocks' values); no tokenizer (the test passes the HF one)."""
    import gguf
    from gguf.quants import dequantize, quantize

    def experts(name: str, t: torch.Tensor):
        """Write t, in blocks where expert_type says so, and leave the blocks' values in it."""
        if expert_type is None:
            return writer.add_tensor(name, t.contiguous().numpy())
        kind = getattr(gguf.GGMLQuantizationType, expert_type)
        blocks = quantize(t.contiguous().numpy(), kind)
        t.copy_(torch.from_numpy(dequantize(blocks, kind)).view_as(t))
        writer.add_tensor(name, blocks, raw_dtype=kind)

    c = model.config
    next_ = c.model_type == "qwen3_next"
    moe = getattr(c, "num_experts", 0) > 0
    arch = "qwen3next" if next_ else "qwen35moe" if moe else "qwen35"
    writer = gguf.GGUFWriter(str(path), arch)
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    meta = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "attention.head_count": c.num_attention_heads,
            "attention.head_count_kv": c.num_key_value_heads, "attention.key_length": c.head_dim,
            "attention.value_length": c.head_dim, "vocab_size": c.vocab_size, "ssm.conv_kernel": c.linear_conv_kernel_dim,
            "ssm.state_size": dk, "ssm.group_count": hk, "ssm.time_step_rank": hv, "ssm.inner_size": hv * dv,
            "full_attention_interval": 4,
            "rope.dimension_count": int(c.head_dim * c.rope_parameters["partial_rotary_factor"])}
    if moe:
        meta.update({"expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
                     "expert_feed_forward_length": c.moe_intermediate_size,
                     "expert_shared_feed_forward_length": c.shared_expert_intermediate_size})
    if not moe or next_:
        meta["feed_forward_length"] = c.intermediate_size
    for name, value in meta.items():
        writer.add_uint32(f"{arch}.{name}", value)
    writer.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "linear_attn.in_proj_ba": "ssm_ba", "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
             "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate", "linear_attn.norm": "ssm_norm",
             "linear_attn.out_proj": "ssm_out", "linear_attn.conv1d": "ssm_conv1d", "mlp.gate": "ffn_gate_inp",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    per_k, qk = hv // hk, 2 * hk * dk
    for name, original in model.state_dict().items():
        t = original.float().clone()
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            t = t + 1
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            writer.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                               "lm_head.weight": "output.weight"}[name], t.numpy())
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        blk, base = f"blk.{layer}.", rest.removesuffix(".weight")
        if not next_ and rest.startswith("linear_attn."):  # Qwen3.5: value heads tiled
            if base in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
                t = torch.cat([t[:qk], _tiled(t[qk:], 0, hk, per_k, dv)])
            elif base == "linear_attn.in_proj_z":
                t = _tiled(t, 0, hk, per_k, dv)
            elif base in ("linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.A_log", "linear_attn.dt_bias"):
                t = _tiled(t, 0, hk, per_k, 1)
            elif base == "linear_attn.out_proj":
                t = _tiled(t, 1, hk, per_k, dv)
        if rest == "linear_attn.A_log":
            writer.add_tensor(blk + "ssm_a", (-t.exp()).numpy())
        elif rest == "linear_attn.dt_bias":
            writer.add_tensor(blk + "ssm_dt.bias", t.numpy())
        elif rest == "linear_attn.in_proj_qkvz.weight":  # per key head [q, k, v, z] -> [q..., k..., v...], [z...]
            q, k, v, z = t.view(hk, -1, t.shape[1]).split([dk, dk, per_k * dv, per_k * dv], 1)
            writer.add_tensor(blk + "attn_qkv.weight", torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)]).numpy())
            writer.add_tensor(blk + "attn_gate.weight", z.reshape(-1, t.shape[1]).contiguous().numpy())
        elif rest == "mlp.experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            experts(blk + "ffn_gate_exps.weight", gate)
            experts(blk + "ffn_up_exps.weight", up)
            original.copy_(t)  # the blocks' values back into the model
        elif rest == "mlp.experts.down_proj":
            experts(blk + "ffn_down_exps.weight", t)
            original.copy_(t)
        else:
            writer.add_tensor(blk + names[base] + ".weight", (t.squeeze(1) if "conv1d" in rest else t).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", ["qwen3next", "qwen35", "qwen35moe"])
def test_a_hybrid_gguf_file_gives_the_checkpoint_tokens(tmp_path, tiny_model_dir, family):
    """The checkpoint as llama.cpp converts it to GGUF (Qwen3-Next with every MLP sparse, as llama.cpp requires;
    Qwen3.5 dense and MoE, value heads tiled): it loads as Qwen3.5's layout, with the checkpoint's greedy tokens and
    logprobs."""
    if family == "qwen3next":
        path = write_hf_next(tmp_path, tiny_model_dir("tiny-qwen3"), **{**CONFIGS["top2-renormalized-dense-layer"],
                                                                        "mlp_only_layers": []})
        hf = HFQwen3Next.from_pretrained(path, dtype=torch.float32).eval()
    else:
        path, model_class = _write_hf_qwen3_5(tmp_path, tiny_model_dir("tiny-qwen3"), moe=family == "qwen35moe")
        hf = model_class.from_pretrained(path, dtype=torch.float32).eval()
    gguf_path = tmp_path / f"{family}.gguf"
    write_hybrid_gguf(hf, gguf_path)
    llm = LLM(str(gguf_path), tokenizer=path, device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert type(llm.llm_engine.model_runner.model).__name__ == "Qwen3_5ForCausalLM"
    assert_greedy_matches_hf(llm, hf, _prompts((7, 45), seed=6), 10)


@pytest.mark.parametrize("family", ["qwen3next", "qwen35moe"])
def test_a_hybrid_gguf_file_keeps_its_experts_in_blocks(tmp_path, tiny_model_dir, family):
    """Experts in Q8_0 blocks, the rest F32: with quantization="gguf" the routed experts stay in their blocks (the CPU
    twin dequantizes the ones a step routes to), the rest is dense, and the tokens are HF's on the blocks' values."""
    if family == "qwen3next":
        path = write_hf_next(tmp_path, tiny_model_dir("tiny-qwen3"), **{**CONFIGS["top2-renormalized-dense-layer"],
                                                                        "mlp_only_layers": []})
        hf = HFQwen3Next.from_pretrained(path, dtype=torch.float32).eval()
    else:
        path, model_class = _write_hf_qwen3_5(tmp_path, tiny_model_dir("tiny-qwen3"), moe=True)
        hf = model_class.from_pretrained(path, dtype=torch.float32).eval()
    gguf_path = tmp_path / f"{family}-q8_0-experts.gguf"
    write_hybrid_gguf(hf, gguf_path, expert_type="Q8_0")
    llm = LLM(str(gguf_path), tokenizer=path, device="cpu", quantization="gguf", max_model_len=256,
              kv_cache_memory_bytes=16 << 20)
    sparse = [layer.mlp for layer in llm.llm_engine.model_runner.model.model.layers if hasattr(layer.mlp, "experts")]
    assert sparse and all(block.experts.w13 is None for block in sparse)
    assert {part.type_name for block in sparse for part in block.experts.quantized.parts.values()} == {"Q8_0"}
    assert_greedy_matches_hf(llm, hf, _prompts((7, 45), seed=6), 10)


@pytest.mark.parametrize("tiers", ["host", "host and disk"])
def test_experts_kept_in_blocks_stream_past_the_device(tmp_path, tiny_model_dir, monkeypatch, tiers):
    """Q8_0 experts past the device (here the CPU plays it): 3 of 6 a layer held, the others in host memory (and 2
    of them on disk), moved as their blocks when routed, the held set revised every 3 forwards of a layer: the
    tokens of the run that holds them all."""
    import nanovllm.streaming.expert_offload as expert_offload
    from nanovllm.streaming.expert_offload import ExpertOffload

    monkeypatch.setattr(expert_offload, "REVISE_EVERY", 3)
    path, model_class = _write_hf_qwen3_5(tmp_path, tiny_model_dir("tiny-qwen3"), moe=True)
    gguf_path = tmp_path / "q8_0-experts.gguf"
    write_hybrid_gguf(model_class.from_pretrained(path, dtype=torch.float32).eval(), gguf_path, expert_type="Q8_0")
    kw = dict(tokenizer=path, device="cpu", quantization="gguf", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    prompts = [{"prompt_token_ids": p} for p in _prompts((7, 45), seed=6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(gguf_path), **kw).generate(prompts, params, use_tqdm=False)]
    gib = 4 * (3 * 64 * 34) / (1 << 30)  # one expert in each of the 4 layers: gate, up, down 64 Q8_0 blocks each
    budgets = dict(cpu_offload_gb=3 * gib) if tiers == "host" else \
        dict(cpu_offload_gb=gib, disk_offload_gb=2 * gib, offload_folder=str(tmp_path))
    llm = LLM(str(gguf_path), **kw, **budgets)
    offload = llm.llm_engine.model_runner.streamer
    assert isinstance(offload, ExpertOffload) and offload.placement.resident == 3
    assert offload.placement.disk == (2 if tiers == "host and disk" else 0)
    assert {t.dtype for t in offload.pool.stacks.values()} == {torch.uint8, torch.float16}  # Q8_0's fields, not dense
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert offload.num_loaded > 0 and any(layer.resident != [0, 1, 2] for layer in offload.layers)
