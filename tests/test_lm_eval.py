"""nanovllm as an lm-evaluation-harness model (entrypoints/lm_eval.py) on a tiny model: loglikelihoods (with the
greedy flag) and rolling loglikelihoods equal HF transformers' on the same token ids; generate_until stops at its
until strings; lm_eval's own simple_evaluate runs a local task through it (no hub)."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from nanovllm.entrypoints.lm_eval import NanoVLLM  # noqa: E402


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    path = tiny_model_dir("tiny-llama")
    return NanoVLLM(path, device="cpu", max_model_len=64, kv_cache_memory_bytes=16 << 20), \
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logprob(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = hf(ids).logits[0].float().log_softmax(-1)
    rows = logprobs[len(context) - 1:len(ids[0]) - 1]
    target = torch.tensor(continuation)
    return rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())


def test_loglikelihoods_equal_hf(model):
    lm, hf = model
    pairs = [("t5 t9 t12", " t7 t8"), ("t100", " t101"), ("", "t3 t4 t5"), ("t9 t9 ", "t9")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    for (context, continuation), (logprob, greedy) in zip(pairs, lm.loglikelihood(requests)):
        want, want_greedy = _hf_logprob(hf, *lm._pair(context, continuation))
        assert logprob == pytest.approx(want, abs=1e-4) and greedy == want_greedy
    greedy_pair = lm._pair("t5 t9", "")[0], [int(torch.argmax(hf(torch.tensor([lm._pair("t5 t9", "")[0]])).logits[0, -1]))]
    assert lm._score([greedy_pair])[0][1]  # its own greedy token is greedy


def test_rolling_loglikelihood_covers_every_token_once(model):
    """A text longer than the 64-token context: the windows' logprobs sum to HF's, window by window."""
    lm, hf = model
    text = " ".join(f"t{3 + (i * 37) % 500}" for i in range(150))
    [total] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows = map(make_disjoint_window, get_rolling_token_windows(lm._encode(text), lm.prefix_token_id, 63, 1))
    assert total == pytest.approx(sum(_hf_logprob(hf, c, t)[0] for c, t in windows), abs=1e-3)


def test_generate_until_stops_at_until(model):
    lm, _ = model
    free = lm.generate_until([Instance("generate_until", {}, ("t5 t9", {"max_gen_toks": 12}), 0)])[0]
    cut = free.split()[3]
    [stopped] = lm.generate_until([Instance("generate_until", {}, ("t5 t9", {"until": [cut], "max_gen_toks": 12}), 0)])
    assert stopped == free[:free.index(cut)]


def _local_task(tmp_path):
    rows = [{"question": f"t{5 + i} t{9 + i}", "choices": [f" t{20 + i}", f" t{30 + i}"], "answer": i % 2}
            for i in range(4)]
    (tmp_path / "data.json").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "tiny_task.yaml").write_text(
        "task: tiny_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(tmp_path / "data.json")
        + "\noutput_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")


def test_simple_evaluate_runs_a_local_task(model, tmp_path):
    """lm_eval.simple_evaluate with the engine and a task defined in a local YAML over a local JSON file."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    _local_task(tmp_path)
    results = lm_eval.simple_evaluate(model=model[0], tasks=["tiny_task"],
                                      task_manager=TaskManager(include_path=str(tmp_path)))
    assert 0 <= results["results"]["tiny_task"]["acc,none"] <= 1


def test_the_lm_eval_command_finds_the_model(tiny_model_dir, tmp_path, capsys):
    """`nanovllm lm-eval run --model nanovllm --model_args pretrained=...`: lm_eval's command line, the model
    registered, the engine's arguments from model_args."""
    from nanovllm.entrypoints import cli

    _local_task(tmp_path)
    args = f"pretrained={tiny_model_dir('tiny-llama')},device=cpu,max_model_len=64,kv_cache_memory_bytes={16 << 20}"
    assert cli.main(["lm-eval", "run", "--model", "nanovllm", "--model_args", args, "--tasks", "tiny_task",
                     "--include_path", str(tmp_path)]) == 0
    assert "tiny_task" in capsys.readouterr().out
