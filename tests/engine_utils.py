"""Helpers shared by the engine test suites."""

from __future__ import annotations

import random
import weakref

import msgspec

from minivllm.core.step_work import SeqWork
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.outputs import OutputAccumulator, RequestOutput
from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams

# Speculative configs that draft whenever possible (adaptive: false), so every test exercises verification
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": None,
    "adaptive": False,
}
EARLY_EXIT = {
    "method": "early_exit",
    "exit_layer": 1,
    "num_speculative_tokens": 3,
    "disable_by_batch_size": None,
    "adaptive": False,
}

# Batched and alone runs (or compiled and eager ones) sum in different orders, and rounding of
# activations can turn a last-bit difference into a flipped near-tie (docs/ARCHITECTURE.md).
NEAR_TIE_NATS = 0.25


def first_part_at_a_near_tie(reference, other) -> int | None:
    """Where `other`'s greedy tokens part from `reference`'s (a CompletionOutput with logprobs), or
    None; asserts that `other` took a token the reference rated within NEAR_TIE_NATS of its pick."""
    j = next((i for i, (a, b) in enumerate(zip(reference.token_ids, other.token_ids)) if a != b), None)
    if j is None:
        return None
    chosen, taken = reference.token_ids[j], other.token_ids[j]
    assert taken in reference.logprobs[j], f"token {j}: {taken} is not among the reference's candidates"
    gap = reference.logprobs[j][chosen] - reference.logprobs[j][taken]
    assert gap <= NEAR_TIE_NATS, f"parted at token {j} where the reference preferred its token by {gap:.3f} nats"
    return j


def make_engine(loaded, **config) -> LLMEngine:
    config.setdefault("num_blocks", 64)
    config.setdefault("metrics_interval_s", 3600.0)
    return LLMEngine(loaded, EngineConfig(**config))


class EventLog:
    """Subscribes to an engine's bus and keeps every event."""

    def __init__(self, engine: LLMEngine):
        self.events: list[ev.Event] = []
        engine.bus.subscribe(self.events.append)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


_WHOLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_engine(engine: LLMEngine) -> list[RequestOutput]:
    """One engine step; its outputs whole (the engine reports deltas; each engine's accumulate here,
    so tests that step by hand and then `run` still see every token)."""
    whole = _WHOLE.setdefault(engine, OutputAccumulator())
    return [whole.add(out) for out in engine.step()]


async def whole(outputs) -> RequestOutput:
    """The last output of an AsyncEngine stream, with every delta before it folded in."""
    fold, out = OutputAccumulator(), None
    async for delta in outputs:
        out = fold.add(delta)
    assert out is not None, "the stream ended without an output"
    return out


def run(
    engine: LLMEngine, max_steps: int = 5000, check_every_step: bool = True, on_step=None
) -> dict[str, RequestOutput]:
    """Steps until idle; returns the final output of every request that finished. Checks the block
    manager's invariants after every step; fails instead of hanging if the engine makes no progress."""
    done: dict[str, RequestOutput] = {}
    for number in range(max_steps):
        if not engine.has_work():
            return done
        if on_step is not None:
            on_step(number)
        for out in step_engine(engine):
            if out.finished:
                done[out.request_id] = out
        if check_every_step:
            engine.block_manager.check_invariants()
    raise AssertionError(
        f"engine still busy after {max_steps} steps: "
        f"{[(r.request_id, r.status.value) for r in engine.requests.values()]}"
    )


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert not engine.requests, f"requests left: {list(engine.requests)}"
    assert all(b.ref_count == 0 for b in bm.blocks), [b.block_id for b in bm.blocks if b.ref_count]
    assert bm.num_free_blocks == bm.num_blocks
    assert not bm.snapshot()["tables"], "block tables left behind"
    assert not engine.scheduler.running and not engine.scheduler.waiting


def chat_ids(tokenizer, question: str, system: str | None = None) -> list[int]:
    from minivllm.text.tokenizer_utils import load_chat_template_prompt

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return load_chat_template_prompt(tokenizer, messages)


def compare(folded: ev.Snapshot, snap: ev.Snapshot) -> None:
    """Blocks exactly; every request of the later snapshot, by id."""
    assert folded.blocks == snap.blocks
    assert folded.step == snap.step and folded.config == snap.config
    assert folded.seq == snap.seq
    by_id = {r.request_id: r for r in folded.requests}
    for request in snap.requests:
        assert request.request_id in by_id, f"{request.request_id} missing from the folded state"
        assert by_id[request.request_id] == request, (
            f"{request.request_id}:\n folded   {msgspec.json.encode(by_id[request.request_id])}\n"
            f" snapshot {msgspec.json.encode(request)}"
        )


def random_decode_works(
    rng: random.Random, rows: int, num_blocks: int, block_size: int = 16, max_width: int = 8, vocab: int = 49152
) -> list[SeqWork]:
    """`rows` single-token decode rows of a tiny-vocabulary model: random tokens, block tables of 1 to
    `max_width` distinct blocks (never block 0), a random context length within each table."""
    works = []
    for _ in range(rows):
        width = rng.randint(1, max_width)
        table = rng.sample(range(1, num_blocks), width)
        works.append(
            SeqWork([rng.randrange(vocab)], rng.randint((width - 1) * block_size, width * block_size - 1), table)
        )
    return works


# Greedy, n > 1 (seeded sampling) and beam search: what a decode path must carry through the whole engine
SAMPLING_MIX = [
    ("greedy", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
    ("n3", SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=7, max_tokens=20, ignore_eos=True)),
    ("beam", SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=12, ignore_eos=True)),
]


def sampling_mix_outputs(loaded, max_num_seqs: int) -> dict[str, list[list[int]]]:
    """Each SAMPLING_MIX request's completions' tokens, served together by a fresh engine (blocks checked free)."""
    engine = make_engine(loaded, max_num_seqs=max_num_seqs, num_blocks=96)
    for i, (name, params) in enumerate(SAMPLING_MIX):
        engine.add_request(name, prompt_token_ids=[5 + i, 17, 300, 4000, 9], params=params)
    done = run(engine)
    assert_all_blocks_free(engine)
    return {rid: [o.token_ids for o in out.outputs] for rid, out in done.items()}
