"""The Ray Data integration (entrypoints/ray_data.py) on a local Ray cluster of two CPUs (what ray.init() gives a
2-core machine) with two replicas: the rows are read from a file (a read task needs a CPU the replicas must leave),
and every row's generation equals one process's, matched by the row's id, with preprocess and postprocess
applied."""
import json

import pytest

from nanovllm import LLM, SamplingParams

ray = pytest.importorskip("ray")

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_cpu_replicas_give_one_process_outputs(cluster, tiny_model_dir, tmp_path):
    from nanovllm.entrypoints.ray_data import ProcessorConfig, build_processor

    model = tiny_model_dir("tiny-llama")
    rows = [{"id": i, "ids": list(range(3 + i, 20 + 2 * i)), "max_tokens": 4 + i % 5} for i in range(24)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    processor = build_processor(
        ProcessorConfig(model=model, engine_kwargs=ENGINE, concurrency=2, batch_size=5),
        preprocess=lambda row: {**row, "prompt_token_ids": row["ids"],
                                "sampling_params": {"temperature": 0, "max_tokens": row["max_tokens"],
                                                    "ignore_eos": True}},
        postprocess=lambda row: {"id": row["id"], "tokens": list(row["generated_token_ids"]),
                                 "count": row["num_generated_tokens"]})
    got = {row["id"]: row for row in processor(ray.data.read_json(str(path))).take_all()}
    want = LLM(model, **ENGINE).generate(
        [{"prompt_token_ids": r["ids"]} for r in rows],
        [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in rows], use_tqdm=False)
    assert sorted(got) == [r["id"] for r in rows]
    for row, out in zip(rows, want):
        assert got[row["id"]]["tokens"] == list(out.outputs[0].token_ids)
        assert got[row["id"]]["count"] == row["max_tokens"]


def test_replicas_leave_a_cpu_to_read_rows():
    from nanovllm.entrypoints.ray_data import replica_cpus

    assert replica_cpus(2, None, 2) == 0.5 and replica_cpus(4, None, 3) == 0.5 and replica_cpus(2, None, 16) == 1
    assert replica_cpus(3, 2, 8) == 2
    with pytest.raises(ValueError, match="concurrency=2 replicas of num_cpus=1 take 2 of the Ray cluster's 2 CPUs"):
        replica_cpus(2, 1, 2)
    with pytest.raises(ValueError, match="the Ray cluster has 1 CPU"):
        replica_cpus(1, None, 1)


def test_replicas_that_take_every_cpu_are_refused_at_once(cluster, tiny_model_dir):
    from nanovllm.entrypoints.ray_data import ProcessorConfig, build_processor

    with pytest.raises(ValueError, match="lower concurrency or num_cpus"):
        build_processor(ProcessorConfig(model=tiny_model_dir("tiny-llama"), engine_kwargs=ENGINE, concurrency=2,
                                        num_cpus=1))


def test_a_row_without_a_prompt_names_the_columns(cluster, tiny_model_dir):
    from nanovllm.entrypoints.ray_data import EngineStage

    stage = EngineStage(tiny_model_dir("tiny-llama"), ENGINE)
    with pytest.raises(ValueError, match="needs 'prompt', 'prompt_token_ids' or 'messages'"):
        stage._prompt({"text": "hi"})


def test_run_batch_on_ray_writes_what_it_writes_alone(cluster, tiny_model_dir, tmp_path):
    """`nanovllm run-batch --ray`: two replicas, the same results and errors as one process (ids and timestamps
    aside), in input order."""
    import json

    from test_run_batch import LINES

    from nanovllm.entrypoints import cli

    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in LINES) + "\n")
    files = {}
    for name, extra in (("alone", []), ("ray", ["--ray", "--ray-replicas", "2", "--chunk-size", "4"])):
        out = tmp_path / f"{name}.jsonl"
        assert cli.main(["run-batch", "-i", str(batch), "-o", str(out), "--model", tiny_model_dir("tiny-llama"),
                         "--device", "cpu", "--max-model-len", "64", "--served-model-name", "m", *extra]) == 0
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        for line in lines:
            line["response"]["body"].pop("created")
        errors = [json.loads(line) for line in (tmp_path / f"{name}.jsonl.errors.jsonl").read_text().splitlines()]
        files[name] = lines, sorted(errors, key=lambda e: e["line"])
    assert files["ray"] == files["alone"]
    assert [line["custom_id"] for line in files["ray"][0]] == ["c1", "c2", "c9"]
