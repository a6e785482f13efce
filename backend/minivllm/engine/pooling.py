"""Pooling requests in the engine (embeddings): built and checked on arrival, finished in the step
their prompt's last chunk ran.

A pooling request is scheduled like any other (admission, chunked prefill under the step's token
budget, preemption), so it shares steps with running generations without stalling them for longer
than a prefill chunk. It samples nothing: the runner hands its rows' final hidden states to its
`PromptPooling` (core/pooling.py), and once the prompt is computed the request finishes, which
frees its blocks at once (the full ones stay in the prefix cache, as any finished prompt's).
"""

from __future__ import annotations

from collections.abc import Mapping

from minivllm.core.pooling import PoolingParams, PromptPooling
from minivllm.core.request import Request
from minivllm.core.scheduler import SchedulerOutput
from minivllm.engine.outputs import PoolingRequestOutput, RequestMetrics
from minivllm.engine.request_tracker import RequestTracker
from minivllm.engine.request_validation import RequestLimits, validate_pooling_prompt
from minivllm.errors import RequestRejectedError
from minivllm.sampling.params import SamplingParams

NO_SAMPLING = SamplingParams(max_tokens=1)  # what code shared with generation reads; nothing is drawn


def pooling_requests(
    request_ids: list[str],
    prompts: list[list[int]],
    pooling: PoolingParams,
    priority: int,
    live: Mapping[str, Request],
    limits: RequestLimits,
) -> list[Request]:
    """One request per prompt (token ids), every one checked before any is returned: all or none.
    With several prompts, a rejection names the prompt's index. Each gets its arrival time when
    `RequestTracker.add` queues it."""
    pooling.validate()
    if len(request_ids) != len(prompts):
        raise ValueError(f"{len(request_ids)} request ids for {len(prompts)} prompts")
    taken = next((rid for i, rid in enumerate(request_ids) if rid in live or rid in request_ids[:i]), None)
    if taken is not None:
        raise ValueError(f"request id {taken!r} is already in use")
    for i, ids in enumerate(prompts):
        try:
            validate_pooling_prompt(ids, limits)
        except RequestRejectedError as exc:
            raise (RequestRejectedError(f"prompt {i}: {exc}", exc.param) if len(prompts) > 1 else exc) from None
    return [
        Request(
            rid,
            None,
            list(ids),
            NO_SAMPLING,
            0.0,
            max_tokens=0,
            priority=priority,
            pooling=PromptPooling(pooling, len(ids)),
        )
        for rid, ids in zip(request_ids, prompts)
    ]


def finish_pooled(sched: SchedulerOutput, tracker: RequestTracker) -> list[PoolingRequestOutput]:
    """Finish the pooling requests whose prompt this step completed (after `update_from_output`);
    returns their outputs. A failure to pool fails that request alone."""
    outputs = []
    for s in sched.scheduled:
        request = s.seq.request
        if request.pooling is None or not s.completes or request.is_finished:
            continue
        tracker.finish(request, "stop", "finished: prompt pooled")
        out = tracker.contained(request, "pooling", pooled_output, request)
        if out is not None:
            outputs.append(out)
    return outputs


def pooled_output(request: Request) -> PoolingRequestOutput:
    assert request.pooling is not None
    return PoolingRequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        embedding=request.pooling.vector(),
        metrics=RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            finished_time=request.finish_time,
            num_cached_tokens=request.num_cached_prompt_tokens,
            num_preemptions=request.num_preemptions,
        ),
    )
