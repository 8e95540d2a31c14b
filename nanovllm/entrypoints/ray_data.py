"""Data parallelism over Ray Data: a dataset of prompts mapped through one LLM per replica (a GPU, or a CPU
worker), the way ray.data.llm's processors serve vLLM.

    processor = build_processor(ProcessorConfig(model="...", concurrency=2, engine_kwargs={...}),
                                preprocess=lambda row: {**row, "prompt": ...}, postprocess=...)
    results = processor(ray.data.from_items(rows))   # a lazy Dataset; every input column is carried through

A row asks for one generation by `prompt` (text), `prompt_token_ids` or `messages` (a chat, through the model's
template), with an optional `sampling_params` dict (SamplingParams' fields); it gains `generated_text`,
`generated_token_ids`, `num_input_tokens` and `num_generated_tokens`. Rows keep their own columns (an `id`, say),
so results are matched by those, not by order. The driver holds only what the dataset's consumer takes. Ray is an
optional extra: pip install "nanovllm[ray]"."""
from collections.abc import Callable
from dataclasses import dataclass, field

from nanovllm.sampling_params import SamplingParams


@dataclass
class ProcessorConfig:
    model: str
    engine_kwargs: dict = field(default_factory=dict)  # LLM()'s keywords
    concurrency: int = 1  # LLM replicas
    batch_size: int = 64  # rows a replica takes at a time
    num_gpus: float | None = None  # a replica's; None: its tensor_parallel_size where Ray sees GPUs, else 0 (CPU)
    num_cpus: float | None = None  # a replica's; None: 1, or less where the replicas would leave no CPU to the rest


class EngineStage:
    """One replica: an LLM, serving batches of rows (pandas DataFrames)."""

    def __init__(self, model: str, engine_kwargs: dict):
        from nanovllm import LLM

        self.llm = LLM(model, **engine_kwargs)

    def __call__(self, batch):
        rows = batch.to_dict("records")
        prompts = [self._prompt(row) for row in rows]
        params = [SamplingParams(**(row.get("sampling_params") or {})) for row in rows]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        batch = batch.copy()
        batch["generated_text"] = [o.outputs[0].text for o in outputs]
        batch["generated_token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
        batch["num_input_tokens"] = [len(o.prompt_token_ids) for o in outputs]
        batch["num_generated_tokens"] = [len(o.outputs[0].token_ids) for o in outputs]
        return batch

    def _prompt(self, row: dict):
        if _given(row.get("messages")):
            return self.llm.chat_prompt(list(row["messages"]))
        if _given(row.get("prompt_token_ids")):
            return {"prompt_token_ids": [int(t) for t in row["prompt_token_ids"]]}
        if isinstance(row.get("prompt"), str):
            return row["prompt"]
        raise ValueError(f"a row needs 'prompt', 'prompt_token_ids' or 'messages'; it has {sorted(row)}")


def _given(value) -> bool:
    return value is not None and not (isinstance(value, float) and value != value) and len(value) > 0  # NaN: absent


def build_processor(config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None, stage: type = EngineStage,
                    stage_kwargs: dict | None = None) -> Callable:
    """A function from a ray.data.Dataset to the dataset of its generations: preprocess (row -> row), the LLM
    replicas, postprocess (row -> row). stage: the replicas' class, built with (model, engine_kwargs,
    **stage_kwargs) and called on pandas batches (run-batch's serves its request lines)."""
    import ray

    if config.concurrency < 1 or config.batch_size < 1:
        raise ValueError(f"concurrency and batch_size must be >= 1, got {config.concurrency}, {config.batch_size}")
    if not ray.is_initialized():
        ray.init()  # what Ray Data would do at the first read: the cluster is known before anything starts
    resources = ray.cluster_resources()
    num_gpus = config.num_gpus
    if num_gpus is None:
        num_gpus = config.engine_kwargs.get("tensor_parallel_size", 1) if resources.get("GPU", 0) else 0
    num_cpus = replica_cpus(config.concurrency, config.num_cpus, resources.get("CPU", 0))

    def process(dataset):
        if preprocess is not None:
            dataset = dataset.map(preprocess)
        dataset = dataset.map_batches(stage, fn_constructor_kwargs=dict(model=config.model,
                                                                       engine_kwargs=config.engine_kwargs,
                                                                       **(stage_kwargs or {})),
                                      batch_size=config.batch_size, batch_format="pandas",
                                      compute=ray.data.ActorPoolStrategy(size=config.concurrency),
                                      num_gpus=num_gpus, num_cpus=num_cpus)
        return dataset.map(postprocess) if postprocess is not None else dataset

    return process


def replica_cpus(concurrency: int, num_cpus: float | None, cluster_cpus: float) -> float:
    """The CPUs each replica reserves, leaving one of the cluster's to the tasks that read, preprocess and
    postprocess rows (with every CPU held by replicas, those tasks wait for ever, and so do the replicas). None: 1,
    or an equal share of all but one CPU where that is less; a number that leaves no CPU is an error."""
    spare = cluster_cpus - 1
    if num_cpus is None:
        if spare <= 0:
            raise ValueError(f"the Ray cluster has {cluster_cpus:g} CPU: the replicas and the tasks that read and "
                             "preprocess rows need at least 2 (ray.init(num_cpus=2))")
        return min(1.0, spare / concurrency)
    if num_cpus < 0 or concurrency * num_cpus > spare:
        raise ValueError(f"concurrency={concurrency} replicas of num_cpus={num_cpus:g} take {concurrency * num_cpus:g} "
                         f"of the Ray cluster's {cluster_cpus:g} CPUs, leaving less than one to read and preprocess "
                         "rows: lower concurrency or num_cpus, or leave num_cpus=None to fit them")
    return num_cpus
