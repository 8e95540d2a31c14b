"""Sampling: seeds, n > 1, stop strings and ids, min_tokens, and the sampler against plain references."""
import pytest
import torch
from conftest import assert_no_leaks
from transformers import AutoModelForCausalLM

from nanovllm import SamplingParams
from nanovllm.layers.sampler import Sampler, SamplingTensors, apply_penalties, apply_top_k_top_p, gumbel_argmax_reference

PROMPT = {"prompt_token_ids": [5, 99, 23, 400, 17, 256, 8]}
OTHERS = [{"prompt_token_ids": [i + 3, 2 * i + 9, 100 + i]} for i in range(6)]


def _ids(out, i=0):
    return out.outputs[i].token_ids


def test_seeded_request_is_reproducible_in_any_batch(tiny_llm):
    params = SamplingParams(temperature=2.0, top_p=0.95, top_k=200, seed=1234, max_tokens=30, ignore_eos=True)
    alone = tiny_llm.generate(PROMPT, params, use_tqdm=False)[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    batch = tiny_llm.generate(OTHERS[:3] + [PROMPT] + OTHERS[3:], [unseeded] * 3 + [params] + [unseeded] * 3,
                              use_tqdm=False)
    assert _ids(batch[3]) == _ids(alone)
    other_seed = tiny_llm.generate(PROMPT, SamplingParams(temperature=2.0, top_p=0.95, top_k=200, seed=99,
                                                          max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    assert _ids(other_seed) != _ids(alone)
    assert_no_leaks(tiny_llm)


def test_n_completions(tiny_llm):
    params = SamplingParams(n=4, temperature=2.0, seed=5, max_tokens=12, ignore_eos=True)
    out = tiny_llm.generate([PROMPT, OTHERS[0]], params, use_tqdm=False)
    assert [len(o.outputs) for o in out] == [4, 4]
    assert [c.index for c in out[0].outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    again = tiny_llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out[0].outputs]
    assert_no_leaks(tiny_llm)


def test_stop_strings_and_stop_token_ids(tiny_llm):
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = tiny_llm.generate(PROMPT, base, use_tqdm=False)[0].outputs[0]
    words = ref.text.split()
    stop = words[4]
    cut = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == ref.text[:ref.text.index(stop)]
    kept = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop,
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == ref.text[:ref.text.index(stop) + len(stop)]
    token = ref.token_ids[6]
    by_id = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                     stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
    first = ref.token_ids.index(token)
    assert by_id.token_ids == ref.token_ids[:first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == token
    assert stop_free(by_id.text, token)
    assert ref.finish_reason == "length" and ref.stop_reason is None
    assert_no_leaks(tiny_llm)


def stop_free(text, token):
    return not text.endswith(f"t{token}")


def test_min_tokens_holds_back_stops(tiny_llm):
    ref = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    token = ref.token_ids[1]
    out = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, min_tokens=8, ignore_eos=True,
                                                   stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
    assert token not in out.token_ids[:8] and len(out.token_ids) >= 8
    assert_no_leaks(tiny_llm)


def _reference_penalties(logits, prompt, output, rep, freq, pres):
    logits = logits.clone()
    for tok in set(prompt) | set(output):
        logits[tok] = logits[tok] / rep if logits[tok] > 0 else logits[tok] * rep
    for tok in set(output):
        logits[tok] -= freq * output.count(tok) + pres
    return logits


def test_penalties_greedy_match_plain_reference(tiny_model_dir, tiny_llm):
    """Greedy decoding with all three penalties equals a step-by-step loop over HF's logits."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("tiny-llama"), dtype=torch.float32).eval()
    rep, freq, pres = 1.3, 0.7, 0.4
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=rep,
                            frequency_penalty=freq, presence_penalty=pres)
    ours = _ids(tiny_llm.generate(PROMPT, params, use_tqdm=False)[0])
    prompt, output = PROMPT["prompt_token_ids"], []
    for _ in range(12):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1]
        output.append(int(_reference_penalties(logits, prompt, output, rep, freq, pres).argmax()))
    assert ours == output
    plain = _ids(tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                   use_tqdm=False)[0])
    assert plain != ours  # the penalties did change something here


def _tensors(B, V, **over):
    base = dict(temperature=torch.ones(B), top_p=torch.ones(B), top_k=torch.full((B,), V), min_p=torch.zeros(B),
                seeds=torch.arange(B), steps=torch.zeros(B, dtype=torch.int64), presence_penalty=torch.zeros(B),
                frequency_penalty=torch.zeros(B), repetition_penalty=torch.ones(B), output_counts=None,
                prompt_mask=None, banned=None, all_greedy=False, any_top_k_p=False, any_min_p=False, max_logprobs=-1)
    return SamplingTensors(**{**base, **over})


def test_penalty_tensors_match_reference():
    g = torch.Generator().manual_seed(0)
    B, V = 4, 50
    logits = torch.randn(B, V, generator=g) * 3
    prompts = [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(B)]
    outputs = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(B)]
    counts = torch.zeros(B, V)
    mask = torch.zeros(B, V, dtype=torch.bool)
    for b in range(B):
        for t in outputs[b]:
            counts[b, t] += 1
        mask[b, prompts[b]] = True
    rep, freq, pres = torch.tensor([1.0, 1.5, 0.8, 2.0]), torch.tensor([0.0, 0.5, -0.5, 1.0]), torch.tensor([0.3, 0, 1, -1.0])
    t = _tensors(B, V, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, output_counts=counts,
                 prompt_mask=mask)
    got = apply_penalties(logits, t)
    for b in range(B):
        want = _reference_penalties(logits[b], prompts[b], outputs[b], rep[b].item(), freq[b].item(), pres[b].item())
        torch.testing.assert_close(got[b], want)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    masked = apply_top_k_top_p(logits, torch.tensor([2, 4, 4]), torch.tensor([1.0, 0.65, 0.75]))
    kept = torch.isfinite(masked)
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, True, False]]
    t = _tensors(1, 4, min_p=torch.tensor([0.6]), any_min_p=True)
    counts = torch.zeros(4)
    for step in range(2000):
        t.steps = torch.tensor([step])
        counts[Sampler()(logits[:1].clone(), t)[0]] += 1
    assert counts[2] == counts[3] == 0  # below 0.6 * max prob
    assert abs(counts[0] / 2000 - 0.4 / 0.7) < 0.04


def test_sampling_frequencies_follow_probabilities():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    draws = 20000
    seeds = torch.full((draws,), 42)
    steps = torch.arange(draws)
    picks = gumbel_argmax_reference(probs.log()[None, :].expand(draws, 4), seeds, steps)
    freq = torch.bincount(picks, minlength=4).float() / draws
    assert torch.allclose(freq, probs, atol=0.015)


def test_noise_never_gives_a_token_an_infinite_score():
    """Seed 2615, step 0, token 3923 hash to the largest noise draw; its uniform once rounded to 1 (E = 0, an
    infinite score), so ~1% of draws over a 150K vocabulary took a token whatever its probability."""
    from nanovllm.layers.sampler import log_exponential_noise

    seeds, steps = torch.tensor([2615]), torch.tensor([0])
    noise = log_exponential_noise(seeds, steps, 4096)
    assert torch.isfinite(noise).all() and noise[0].argmin() == 3923
    logits = torch.zeros(1, 4096)
    logits[0, 0] = 30.0  # all but ~1e-10 of the probability
    assert gumbel_argmax_reference(logits, seeds, steps).item() == 0


def test_greedy_is_argmax():
    logits = torch.randn(3, 100)
    t = _tensors(3, 100, temperature=torch.zeros(3), all_greedy=True)
    assert Sampler()(logits, t)[0].tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_count(tiny_llm, k):
    out = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=k), use_tqdm=False)[0]
    for entry, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
        assert token in entry and len(entry) in (k, k + 1)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)))
