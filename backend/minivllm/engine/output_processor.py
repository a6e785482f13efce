"""Applying one step's samples: forks join their requests, tokens are appended (detokenized, stop
conditions checked, each with its event), finished sequences and requests leave, and every
request that moved reports its output. Runs after `Scheduler.update_from_output`, so forks share
the progress their parent made this step."""

from __future__ import annotations

from minivllm.core.request import Request, Sequence
from minivllm.engine.outputs import RequestOutput
from minivllm.engine.postprocess import append_token, request_output
from minivllm.engine.request_tracker import RequestTracker
from minivllm.engine.step_sampling import RequestSamples, SampledToken
from minivllm.engine.telemetry import Telemetry


class OutputProcessor:
    def __init__(self, tracker: RequestTracker, telemetry: Telemetry, eos_ids: frozenset[int], tokenizer):
        self.tracker = tracker
        self.telemetry = telemetry
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.max_model_len = 0  # set by the engine on every (re)build

    def apply(self, samples: list[RequestSamples]) -> list[RequestOutput]:
        contained = self.tracker.contained
        for drawn in samples:
            if drawn.beam_choices is not None:
                contained(drawn.request, "sampling", self.continue_beams, drawn.request, drawn.beam_choices)
            elif drawn.new_children:
                contained(drawn.request, "forking", self.add_forks, drawn)
        for drawn in samples:
            if drawn.verified is not None:
                self.telemetry.spec_verified(drawn.tokens[0].seq, drawn.verified)
            if drawn.request.error is None and drawn.tokens:
                contained(drawn.request, "post-processing", self.append_all, drawn.tokens)
        for drawn in samples:
            if drawn.request.error is None:
                contained(drawn.request, "finishing", self.tracker.after_sampling, drawn.request)
        return [request_output(d.request) for d in samples if d.request.error is None]

    def add_forks(self, drawn: RequestSamples) -> None:
        for parent, child in drawn.new_children:
            self.tracker.add_fork(drawn.request, parent, child)

    def append_all(self, tokens: list[SampledToken]) -> None:
        for t in tokens:
            if not t.seq.finished:  # a stop inside an accepted run of drafts ends the sequence there
                self.append(t.seq, t.token, t.logprob, t.top, t.drafted, t.allowed_fraction)

    def append(
        self,
        seq: Sequence,
        token: int,
        logprob: float | None,
        top,
        drafted: bool = False,
        allowed_fraction: float | None = None,
    ) -> None:
        text = append_token(seq, token, logprob, top, self.eos_ids, self.max_model_len)
        self.telemetry.token(seq, token, text, logprob, drafted, allowed_fraction)

    # ---- beam search --------------------------------------------------------------------------

    def continue_beams(self, request: Request, choices: list[tuple[int, int]]) -> None:
        """Each chosen (parent, token) becomes a new beam; the old beams leave. No choices: done."""
        old = list(request.seqs)
        for parent_row, token in choices:
            parent = old[parent_row]
            child = self.tracker.new_seq(request, list(parent.token_ids), len(request.seqs) - len(old), parent)
            self.tracker.add_fork(request, parent, child)
            child.token_ids.append(token)  # stop conditions belong to the beam search itself
            self.telemetry.token(child, token, "", None)
        for seq in old:
            self.tracker.drop_seq(request, seq, "beam pruned" if choices else "beam search finished")
        if not choices:
            self._finish_beams(request)

    def _finish_beams(self, request: Request) -> None:
        skip_special = request.params.skip_special_tokens
        for index, (tokens, score) in enumerate(request.beam.results()):
            seq = self.tracker.new_seq(request, request.prompt_token_ids + tokens, index)
            seq.cumulative_logprob = score
            seq.finish_reason = "stop" if tokens and tokens[-1] in self.eos_ids else "length"
            seq.text = self.tokenizer.decode(tokens, skip_special_tokens=skip_special) if self.tokenizer else ""
            request.finished_seqs.append(seq)
