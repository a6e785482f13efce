"""What the engine returns per request per step (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class CompletionOutput:
    """One sample's news since the request's previous output (vLLM's DELTA output kind): the new
    text, token ids and logprobs entries. `OutputAccumulator` folds them into the whole output."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per new token: {token_id: logprob} (chosen + top-N)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    num_tokens: int = 0  # the sample's output tokens so far, all of them (usage needs no accumulation)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed inside the engine
    error_param: str | None = None  # the request field at fault, when the failure is the client's
    # vLLM's prompt_logprobs, in the request's first output only: per prompt token {token_id: logprob}
    # (the prompt token first, then the top-N; None for the first token), and the prompt token's rank
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens of the whole request so far (every sample's)."""
        return sum(o.num_tokens for o in self.outputs)


@dataclass
class PoolingRequestOutput:
    """A pooling request's one output (vLLM's name): its prompt pooled into one vector."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    metrics: RequestMetrics
    finished: bool = True
    error: str | None = None


class OutputAccumulator:
    """Folds the engine's delta outputs into whole ones, per request: what a caller that waits for
    the end (a non-streaming response, `LLM.generate`, a benchmark) keeps."""

    def __init__(self) -> None:
        self._whole: dict[str, RequestOutput] = {}

    def add(self, delta: RequestOutput) -> RequestOutput:
        """The request's whole output so far (final once `finished`; then forgotten here)."""
        whole = self._whole.get(delta.request_id)
        if whole is None:
            whole = replace(delta, outputs=[_copy(o) for o in delta.outputs])
        else:
            _merge(whole, delta)
        if delta.finished:
            self._whole.pop(delta.request_id, None)
        else:
            self._whole[delta.request_id] = whole
        return whole


def _copy(o: CompletionOutput) -> CompletionOutput:
    return replace(o, token_ids=list(o.token_ids), logprobs=None if o.logprobs is None else list(o.logprobs))


def _merge(whole: RequestOutput, delta: RequestOutput) -> None:
    by_index = {o.index: o for o in whole.outputs}
    for new in delta.outputs:
        old = by_index.get(new.index)
        if old is None:  # a sample forked after the first output
            whole.outputs.append(_copy(new))
            whole.outputs.sort(key=lambda o: o.index)
            continue
        old.text += new.text
        old.token_ids.extend(new.token_ids)
        if new.logprobs is not None:
            if old.logprobs is None:
                old.logprobs = []
            old.logprobs.extend(new.logprobs)
        old.cumulative_logprob, old.finish_reason, old.stop_reason, old.num_tokens = (
            new.cumulative_logprob,
            new.finish_reason,
            new.stop_reason,
            new.num_tokens,
        )
    whole.finished, whole.metrics, whole.error = delta.finished, delta.metrics, delta.error
    whole.error_param = delta.error_param
    if delta.prompt_logprobs is not None:
        whole.prompt_logprobs, whole.prompt_logprob_ranks = delta.prompt_logprobs, delta.prompt_logprob_ranks
