"""The live requests and their sequences coming and going: creation, forks, drops, finishing and
failing, each with its event. Progress (`num_computed`) is not moved here; the scheduler owns it."""

from __future__ import annotations

import logging
from collections import deque

import torch

from minivllm.core.request import Request, RequestStatus, Sequence
from minivllm.core.scheduler import Scheduler
from minivllm.engine import wire
from minivllm.engine.outputs import RequestOutput
from minivllm.engine.postprocess import request_output
from minivllm.engine.telemetry import Telemetry
from minivllm.errors import RequestRejectedError
from minivllm.events import types as ev
from minivllm.text.detokenizer import IncrementalDetokenizer
from minivllm.text.stop_strings import StopStringMatcher

FINISHED_HISTORY = 256  # finished requests kept for snapshots (the timeline of late joiners)
log = logging.getLogger("minivllm.engine")


class RequestTracker:
    def __init__(self, telemetry: Telemetry, tokenizer, device: torch.device | str):
        self.telemetry = telemetry
        self.tokenizer = tokenizer
        self.device = device
        self.requests: dict[str, Request] = {}
        self.finished: deque[Request] = deque(maxlen=FINISHED_HISTORY)
        self.failed: list[RequestOutput] = []  # outputs of requests that finished outside a step's flow
        self.scheduler: Scheduler | None = None  # bound by the engine on every (re)build

    # ---- sequences ----------------------------------------------------------------------------

    def new_seq(self, request: Request, token_ids: list[int], index: int, parent: Sequence | None = None) -> Sequence:
        """A sequence with its own sampling state; not yet part of the request (see `add_fork`)."""
        p = request.params
        seq = Sequence(
            request,
            token_ids,
            request.num_prompt_tokens,
            sample_index=index,
            parent_seq_id=parent.seq_id if parent else None,
        )
        if parent is not None:
            seq.inherit_block_hashes(parent)
        if p.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(p.seed + index)
        if self.tokenizer is not None and not p.use_beam_search:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.skip_special_tokens)
        if p.stop and not p.use_beam_search:
            seq.stop_matcher = StopStringMatcher(p.stop, p.include_stop_str_in_output)
        if request.grammar is not None:
            seq.grammar = parent.grammar.fork() if parent is not None and parent.grammar else request.grammar.matcher()
        return seq

    def add_fork(self, request: Request, parent: Sequence, child: Sequence) -> None:
        """The child joins the request, sharing the parent's blocks and progress."""
        child.cumulative_logprob = parent.cumulative_logprob
        request.seqs.append(child)
        self.telemetry.seq_added(request, child)
        self.scheduler.fork(request, parent, child)

    def drop_seq(self, request: Request, seq: Sequence, reason: str, keep: bool = False) -> None:
        request.seqs.remove(seq)
        if keep:
            request.finished_seqs.append(seq)
        self.scheduler.bm.free_seq(seq.seq_id)
        self.telemetry.seq_removed(request, seq, reason)

    # ---- requests -----------------------------------------------------------------------------

    def add(self, request: Request) -> Request:
        """A new request: its first sequence, its arrival (the event's time becomes its arrival time:
        one clock for the engine and the event log), then the waiting queue."""
        request.seqs.append(self.new_seq(request, list(request.prompt_token_ids), 0))
        arrived = self.telemetry.emit(
            ev.RequestArrived(
                request_id=request.request_id,
                prompt_tokens=request.num_prompt_tokens,
                max_tokens=request.max_tokens,
                n=request.params.n,
                priority=request.priority,
                sampling=wire.sampling_summary(request),
                prompt_preview=request.preview,
            )
        )
        request.arrival_time = arrived.ts
        self.requests[request.request_id] = request
        self.telemetry.seq_added(request, request.seqs[0])
        self.telemetry.set_status(request, RequestStatus.WAITING, "arrived")
        self.scheduler.add(request)
        return request

    def finish(self, request: Request, finish_reason: str, words: str) -> None:
        self.scheduler.remove(request)
        for seq in list(request.seqs):
            self.drop_seq(request, seq, words, keep=True)
        request.finish_reason = finish_reason
        request.finish_time = self.telemetry.set_status(request, RequestStatus.FINISHED, words, finish_reason).ts
        del self.requests[request.request_id]
        _release_grammars(request)
        self.finished.append(request)

    def abort(self, request: Request, words: str) -> None:
        for seq in request.seqs:
            seq.finish_reason = seq.finish_reason or "abort"
        self.finish(request, "abort", words)
        self.failed.append(request_output(request))

    def fail(self, request: Request, phase: str, exc: Exception) -> None:
        """Finish a request whose own processing raised: its blocks are freed, its client gets the
        error (RequestOutput.error), and nothing shared (the pool, the batch) is affected."""
        if isinstance(exc, RequestRejectedError):  # the request's own input (a constraint) could not be followed
            log.info("request %s failed while %s: %s", request.request_id, phase, exc)
            request.error, request.error_param = str(exc), exc.param
        else:
            log.error("request %s failed while %s", request.request_id, phase, exc_info=exc)
            request.error = f"internal error while {phase} the request: {type(exc).__name__}: {exc}"
        if request.is_finished:
            self.failed.append(request_output(request))
        else:
            self.abort(request, f"failed while {phase}: {type(exc).__name__}")

    def contained(self, request: Request, phase: str, fn, *args):
        """fn(*args); an exception fails `request` alone and returns None."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a fault in one request must not reach the others
            self.fail(request, phase, exc)
            return None

    def take_failed(self) -> list[RequestOutput]:
        outputs, self.failed = self.failed, []
        return outputs

    def after_sampling(self, request: Request) -> None:
        """First token of a prefill; finished sequences leave; the request ends with its last one."""
        if request.status == RequestStatus.PREFILL:
            self.telemetry.set_status(request, RequestStatus.DECODE, "prompt computed, first token sampled")
        for seq in [s for s in request.seqs if s.finished]:
            self.drop_seq(request, seq, f"finished: {seq.finish_reason}", keep=True)
        if not request.seqs:
            reasons = [s.finish_reason for s in request.finished_seqs]
            reason = "length" if "length" in reasons else (reasons[0] if reasons else "stop")
            self.finish(request, reason, finish_words(reason))


def _release_grammars(request: Request) -> None:
    """A finished request is kept for snapshots (FINISHED_HISTORY of them) but needs its grammar no more:
    holding it kept each compiled grammar (up to ~9 MiB) alive past the grammar cache's bound, and an
    attack run of new large constraints grew RSS by ~7 MiB a request (measured)."""
    request.grammar = None
    for seq in request.all_seqs():
        seq.grammar = None


def finish_words(reason: str) -> str:
    return {
        "stop": "finished: stop condition met",
        "length": "finished: length limit reached",
        "abort": "aborted by the client",
    }.get(reason, f"finished: {reason}")
