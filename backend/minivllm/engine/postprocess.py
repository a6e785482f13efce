"""Appending a sampled token to a sequence: detokenize, check stop conditions, build outputs."""

from __future__ import annotations

from minivllm.core.request import Request, Sequence
from minivllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


def append_token(
    seq: Sequence,
    token_id: int,
    logprob: float | None,
    top: list[tuple[int, float]] | None,
    eos_ids: frozenset[int],
    max_model_len: int,
) -> str:
    """Adds the token, sets `seq.finish_reason` when it ends the sequence; returns the text to emit.
    A token that ends the sequence by itself (EOS, a stop token id) adds no text and no logprobs
    entry: it is not part of the completion a client sees."""
    seq.token_ids.append(token_id)
    if logprob is not None:
        seq.cumulative_logprob += logprob
    if _stopped_by_token(seq, token_id, eos_ids):
        text = flush_text(seq)
    else:
        if logprob is not None and seq.request.params.logprobs is not None:
            seq.top_logprobs.append(dict([(token_id, logprob), *(top or [])]))  # built once, not per output
        delta = seq.detokenizer.append(token_id) if seq.detokenizer else ""
        text = _stop_string_or_length(seq, delta, seq.request.max_tokens, max_model_len)
        if seq.grammar is not None and not seq.finished:
            text += _advance_grammar(seq, token_id)
    seq.text += text
    return text


def _advance_grammar(seq: Sequence, token_id: int) -> str:
    """The grammar follows the token; once nothing but the end can follow, the output is complete
    (vLLM's rule: a finished grammar stops the request without waiting for an EOS step)."""
    seq.grammar.accept(token_id)  # type: ignore[union-attr]
    if not seq.grammar.is_finished:  # type: ignore[union-attr]
        return ""
    seq.finish_reason = "stop"
    return flush_text(seq)


def _stopped_by_token(seq: Sequence, token_id: int, eos_ids: frozenset[int]) -> bool:
    params = seq.request.params
    if seq.num_output_tokens < params.min_tokens:
        return False
    if not params.ignore_eos and token_id in eos_ids:
        seq.finish_reason = "stop"
    elif token_id in params.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token_id
    return seq.finished


def _stop_string_or_length(seq: Sequence, delta: str, max_tokens: int, max_model_len: int) -> str:
    if seq.stop_matcher is not None:
        delta, stopped = seq.stop_matcher.feed(delta)
        if stopped:
            seq.finish_reason, seq.stop_reason = "stop", seq.stop_matcher.matched
            return delta
    if seq.num_output_tokens >= max_tokens or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
        delta += flush_text(seq)
    return delta


def flush_text(seq: Sequence) -> str:
    """Text held back (incomplete UTF-8, a possible stop-string prefix) once nothing more comes."""
    tail = seq.detokenizer.flush() if seq.detokenizer else ""
    if seq.stop_matcher is None:
        return tail
    text, _ = seq.stop_matcher.feed(tail)
    return text + seq.stop_matcher.flush()


def completion_of(seq: Sequence) -> CompletionOutput:
    """What is new in the sequence since its previous output (advances its report marks)."""
    logprobs = None
    if seq.request.params.logprobs is not None:
        logprobs = seq.top_logprobs[seq.reported_logprobs :]
    out = CompletionOutput(
        index=seq.sample_index,
        text=seq.text[seq.reported_text_len :],
        token_ids=seq.token_ids[seq.num_prompt_tokens + seq.reported_tokens :],  # the new ones only: no copy of all
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_tokens=seq.num_output_tokens,
    )
    seq.reported_text_len, seq.reported_tokens, seq.reported_logprobs = (
        len(seq.text),
        seq.num_output_tokens,
        len(seq.top_logprobs),
    )
    return out


def request_output(request: Request) -> RequestOutput:
    """The request's news of this step. Beams are hypotheses until the search ends: a beam request
    reports its finished sequences only."""
    seqs = request.finished_seqs if request.params.use_beam_search else request.all_seqs()
    seqs = sorted(seqs, key=lambda s: s.sample_index)
    prompt = request.prompt_logprobs.take() if request.prompt_logprobs is not None else None
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[completion_of(s) for s in seqs],
        finished=request.is_finished,
        metrics=RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=request.finish_time,
            num_cached_tokens=request.num_cached_prompt_tokens,
            num_preemptions=request.num_preemptions,
        ),
        error=request.error,
        error_param=request.error_param,
        prompt_logprobs=prompt[0] if prompt else None,
        prompt_logprob_ranks=prompt[1] if prompt else None,
    )
