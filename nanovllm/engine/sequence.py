from enum import Enum, auto

from nanovllm.outputs import Logprob
from nanovllm.sampling_params import SamplingParams

PLACEHOLDER_TOKEN = 0  # stands for a token still being sampled on the device (pipelined decode)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One completion of one request: its tokens, its place in the KV cache, and its results so far."""

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, arrival: int):
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.arrival = arrival
        self.params = params
        self.seed = seed  # 32-bit key of this completion's random stream
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of the full blocks of token_ids, filled lazily
        self.num_registered_blocks = 0  # leading blocks of block_table already in the prefix cache
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, how many the prefix cache gave at admission
        self.num_scheduled_tokens = 0  # new tokens in the current step
        self.swapped_blocks: list[int] | None = None  # host pool blocks holding its KV while preempted by swap
        self.host_blocks: list[int] = []  # host pool blocks of its leading KV blocks, offloaded (block_table: -1)
        self.num_placeholders = 0  # tokens at the end still being sampled on the device
        self.state_slot: int | None = None  # linear-attention layers: its state's slot while it runs
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.prompt_logprobs: list[dict[int, Logprob] | None] = []
        self.cumulative_logprob = 0.0
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefill_done(self) -> bool:
        """True once this step's tokens reach the end of the sequence, so a new token is sampled."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)

    def append_placeholder(self):
        """Hold the place of a token still being sampled on the device (a step launched ahead)."""
        self.token_ids.append(PLACEHOLDER_TOKEN)
        self.num_placeholders += 1

    def remove_placeholder(self):
        """Make way for the real token, now read back."""
        self.token_ids.pop()
        self.num_placeholders -= 1

    def sampled_tokens(self, start: int = 0) -> list[int]:
        """The output tokens read back so far (no placeholder), from the start-th on."""
        return self.token_ids[self.num_prompt_tokens + start:len(self.token_ids) - self.num_placeholders]
