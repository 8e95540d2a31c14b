import shutil

import numpy as np
import torch
import torch.nn.functional as F

from nanovllm.quant.gguf_formats import BLOCK_FORMATS, DENSE_TYPES, F16_FIELDS


def kernel_tol(dtype: torch.dtype) -> dict:
    """assert_close tolerances for a kernel against its fp32 reference: bf16 outputs are good to ~3 digits."""
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)


def assert_as_exact_as_dense(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """A quantized kernel's x W^T (weight: the dequantized float32 W) is as close to the exact product as the dense
    model's, W rounded to x's dtype, summed in fp32, rounded to the output's dtype (within 1.5x its largest error): a
    per-element tolerance fails where both land near a zero that they miss by a rounding."""
    exact = F.linear(x.double(), weight.double())
    dense = F.linear(x.float(), weight.to(x.dtype).float()).to(got.dtype)
    limit = 1.5 * (dense.double() - exact).abs().max().item() + 1e-6
    assert (got.double() - exact).abs().max().item() <= limit


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int):
    """HF transformers' greedy generation of exactly max_new_tokens (EOS suppressed until then, as our
    min_tokens does). Returns (token ids, raw log-softmax of each step's logits)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [step[0].float().log_softmax(-1) for step in out.logits]


def hf_prompt_logprobs(model, prompt_ids: list[int]) -> torch.Tensor:
    """[len - 1, V] log-softmax predicting prompt token i + 1 from the tokens up to i."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return logits.log_softmax(-1)


def random_tensor(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of random blocks whose f16 scales are small and finite (any byte pattern of the rest
    is a valid block)."""
    fmt = BLOCK_FORMATS[type_name]
    if type_name in DENSE_TYPES:
        values = rng.normal(size=(rows, cols)).astype(np.float32)
        if type_name == "F16":
            return values.astype(np.float16).view(np.uint8)
        return values.view(np.uint8) if type_name == "F32" else (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(rows, fmt.row_bytes(cols)), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.block_bytes)
    for name, _ in fmt.fields:
        if name in F16_FIELDS:
            at = fmt.offset(name)
            scales = rng.normal(0, 0.01, size=blocks.shape[0]).astype(np.float16)
            blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


def save_tiny_hf(model_class, config, path, tokenizer_dir: str, spread_norms: bool = False) -> str:
    """A random HF model of config, saved with the tiny tokenizer. HF's init leaves routers near zero (and a hybrid's
    zero-centered norms, decay and dt at their defaults): spread them, so that each one matters."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)
            elif spread_norms and name.endswith(("norm.weight", "dt_bias", "A_log")):
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", path / name)
    return str(path)


def assert_greedy_matches_hf(llm, hf, prompts: list[list[int]], max_tokens: int, tol: float = 1e-4) -> list:
    """The engine's greedy tokens of each prompt are HF's, and each token's logprob within tol of HF's. Returns the
    engine's outputs."""
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        tokens, step_logprobs = hf_greedy(hf, prompt, max_tokens)
        assert out.outputs[0].token_ids == tokens
        for entry, ref, token in zip(out.outputs[0].logprobs, step_logprobs, tokens):
            assert abs(entry[token].logprob - ref[token].item()) < tol
    return outputs



def prompt_logprob_gap(llm_a, llm_b, prompt_ids: list[int]) -> float:
    """The largest difference between two engines' logprobs of the prompt's tokens (each given the ones before)."""
    from nanovllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    a, b = (llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].prompt_logprobs[1:]
            for llm in (llm_a, llm_b))
    return max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a, b, prompt_ids[1:]))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of tokens up to each sequence's first difference."""
    same = sum(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b))
    return same / sum(len(s) for s in a)
