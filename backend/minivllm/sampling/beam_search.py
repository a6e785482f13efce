"""Beam search as a step-at-a-time state machine.

It reproduces Hugging Face ``generate(num_beams=k, do_sample=False, early_stopping=False,
length_penalty=lp)`` (transformers 5.x ``GenerationMixin._beam_search``) for one prompt:

* each step scores every ``(live beam, token)`` pair as ``beam_score + logprob`` and keeps the
  top ``2 * k`` candidates (HF keeps ``max(2, 1 + n_eos) * k``; with one EOS that is ``2k``),
  so there are always ``k`` non-EOS continuations even if the best ``k`` all end in EOS;
* a candidate that ends in EOS, or that reaches ``max_tokens``, is *finished*; it is only a
  finished hypothesis if it is among the top ``k`` candidates of the step, with score
  ``sum_logprobs / generated_len ** length_penalty`` (``generated_len`` counts the EOS token);
  the ``k`` best finished hypotheses are kept;
* the ``k`` best unfinished candidates become the next live beams;
* the search stops when every candidate of the step is finished (``max_tokens`` reached) or
  when the HF "early_stopping=False" heuristic says no live beam can improve on the worst kept
  hypothesis: all ``k`` slots are filled and
  ``best_live_score / cur_generated_len ** length_penalty <= worst_kept_score`` (the heuristic
  is sticky: once it says "done", the search is over).

On the first step HF runs ``k`` copies of the prompt with beam scores ``[0, -1e9, ...]``; this
class reproduces that exactly (ties and all) by expanding a single prompt row.
All the arithmetic is done on float32 tensors in the same order as HF, so that
ties and near-ties resolve the same way.
"""

from __future__ import annotations

import torch

_BIG = 1.0e9


class BeamSearchState:
    """Beam search over one prompt, driven one model step at a time by the engine."""

    def __init__(
        self,
        beam_width: int,
        length_penalty: float,
        eos_token_id: int | None,
        max_tokens: int,
        prompt_len: int,
        num_return: int,
    ) -> None:
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {beam_width}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not 1 <= num_return <= beam_width:
            raise ValueError(f"num_return must be in [1, beam_width={beam_width}], got {num_return}")
        self.beam_width = beam_width
        self.length_penalty = float(length_penalty)
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        self.prompt_len = prompt_len
        self.num_return = num_return

        k = beam_width
        n_eos = 1 if eos_token_id is not None else 0
        self._beams_to_keep = max(2, 1 + n_eos) * k
        self._top_k_mask = torch.zeros(self._beams_to_keep, dtype=torch.bool)
        self._top_k_mask[:k] = True

        self._cur_len = prompt_len  # prompt + generated tokens of the live beams
        self._max_length = prompt_len + max_tokens
        # live beams
        self._running_scores = torch.zeros(1, k, dtype=torch.float32)
        self._running_scores[:, 1:] = -_BIG
        self._running_tokens: list[list[int]] = [[] for _ in range(k)]
        # kept finished hypotheses
        self._finished_scores = torch.full((1, k), -_BIG, dtype=torch.float32)
        self._finished_tokens: list[list[int]] = [[] for _ in range(k)]
        self._is_finished = torch.zeros(1, k, dtype=torch.bool)
        self._improvement_possible = torch.ones(1, 1, dtype=torch.bool)
        self._done = False
        self._first = True

    # ------------------------------------------------------------------ engine API
    @property
    def live_beams(self) -> list[list[int]]:
        """Generated tokens of the live beams, in the row order expected by the next ``step``."""
        return [list(t) for t in self._running_tokens]

    def step(self, logprobs: torch.Tensor) -> list[tuple[int, int]]:
        """Advance by one token.

        ``logprobs``: ``[num_live_beams, vocab]`` log-softmax of the model's next-token logits
        for each live beam, in the order returned by the previous ``step`` (first step: one
        row for the prompt, or ``beam_width`` identical rows). Returns the next live beams as
        ``(parent_row, token_id)`` pairs, or ``[]`` once the search is finished.
        """
        if self._done:
            raise RuntimeError("beam search already finished")
        k = self.beam_width
        lp = logprobs.to(torch.float32)
        if lp.dim() != 2:
            raise ValueError(f"logprobs must be 2-D [beams, vocab], got shape {tuple(lp.shape)}")
        first = self._first
        self._first = False
        if first and lp.shape[0] == 1:
            lp = lp.expand(k, -1)
        if lp.shape[0] != k:
            raise ValueError(f"expected {k} rows of logprobs, got {lp.shape[0]}")
        vocab = lp.shape[1]

        # c. top-2k continuations over all (beam, token) pairs
        acc = lp.unsqueeze(0) + self._running_scores[:, :, None]  # [1, k, V]
        acc = acc.reshape(1, -1)
        topk_scores, topk_idx = torch.topk(acc, k=self._beams_to_keep)
        cand_beam = (topk_idx // vocab)[0].tolist()
        cand_tok = (topk_idx % vocab)[0].tolist()
        cand_tokens = [self._running_tokens[b] + [t] for b, t in zip(cand_beam, cand_tok)]

        # d. which candidates are finished (EOS or max length)
        at_max = self._cur_len + 1 >= self._max_length
        hits = torch.tensor(
            [[at_max or (self.eos_token_id is not None and t == self.eos_token_id) for t in cand_tok]],
            dtype=torch.bool,
        )

        # e. next live beams: best k unfinished candidates
        running_cand_scores = topk_scores + hits.to(torch.float32) * -_BIG
        next_idx = torch.topk(running_cand_scores, k=k)[1]
        self._running_scores = torch.take_along_dim(running_cand_scores, next_idx, dim=1)
        next_list = next_idx[0].tolist()
        self._running_tokens = [cand_tokens[j] for j in next_list]
        parents = [0 if first else cand_beam[j] for j in next_list]
        next_tokens = [cand_tok[j] for j in next_list]

        # f. keep the k best finished hypotheses
        just_finished = hits & self._top_k_mask[None, :]
        fin_scores = topk_scores / ((self._cur_len + 1 - self.prompt_len) ** self.length_penalty)
        fin_scores = fin_scores + (~self._improvement_possible).to(torch.float32) * -_BIG
        fin_scores = fin_scores + (~just_finished) * -_BIG
        merged_scores = torch.cat((self._finished_scores, fin_scores), dim=1)
        merged_tokens = self._finished_tokens + cand_tokens
        merged_is_finished = torch.cat((self._is_finished, just_finished), dim=1)
        keep = torch.topk(merged_scores, k=k)[1]
        self._finished_scores = torch.take_along_dim(merged_scores, keep, dim=1)
        self._is_finished = torch.take_along_dim(merged_is_finished, keep, dim=1)
        self._finished_tokens = [merged_tokens[j] for j in keep[0].tolist()]

        # g. stopping condition
        self._cur_len += 1
        best_running = self._running_scores[:, :1] / ((self._cur_len - self.prompt_len) ** self.length_penalty)
        worst_finished = torch.where(self._is_finished, torch.min(self._finished_scores, dim=1, keepdim=True)[0], -_BIG)
        self._improvement_possible = self._improvement_possible & torch.any(
            best_running > worst_finished, dim=-1, keepdim=True
        )
        unfinished = bool(self._improvement_possible.any()) and not bool(hits.all())
        if not unfinished:
            self._done = True
            return []
        return list(zip(parents, next_tokens))

    def results(self) -> list[tuple[list[int], float]]:
        """Best ``num_return`` finished hypotheses as ``(generated token ids, score)``, best first.

        The token ids include the EOS token when a hypothesis ended with it. Before the search
        is finished only the hypotheses completed so far are returned.
        """
        scores = self._finished_scores[0].tolist()
        flags = self._is_finished[0].tolist()
        out = [(list(t), s) for t, s, f in zip(self._finished_tokens, scores, flags) if f]
        return out[: self.num_return]
