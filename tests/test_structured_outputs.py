"""Structured outputs and logit_bias in the engine: grammar masks inside the batched sampler, a
finished grammar ends the request, every sample of many seeds obeys its constraint, bad grammars
are refused before they hold a block, and the combinations (n > 1, logprobs, prefix caching,
beam search, speculative decoding) either work or are refused."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_utils import EventLog, assert_all_blocks_free, make_engine, run
from minivllm.errors import RequestRejectedError
from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams
from minivllm.structured.params import StructuredOutputsParams as Structured

# bounded, so that a random model reaches the end of it (strings and numbers cannot run forever)
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "population", "capital", "tags"],
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["old", "big", "coastal"]}},
    },
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture
def engine(tiny_model):
    return make_engine(tiny_model)


def _constrained(seed: int, structured: Structured, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=structured, **kw)


def _texts(done, prefix: str) -> list[str]:
    return [o.text for rid, out in sorted(done.items()) if rid.startswith(prefix) for o in out.outputs]


@pytest.mark.slow
def test_every_seed_obeys_its_json_schema_regex_and_choice(engine):
    for seed in range(20):
        engine.add_request(f"json{seed:02}", "Hello", _constrained(seed, Structured(json=SCHEMA)))
        engine.add_request(f"regex{seed:02}", "Hello", _constrained(seed, Structured(regex=REGEX)))
        engine.add_request(f"choice{seed:02}", "Hello", _constrained(seed, Structured(choice=CHOICES)))
    done = run(engine)
    for text in _texts(done, "json"):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(re.fullmatch(REGEX, t) for t in _texts(done, "regex")), _texts(done, "regex")
    assert all(t in CHOICES for t in _texts(done, "choice")), _texts(done, "choice")
    assert len(set(_texts(done, "json"))) > 10, "the seeds should give different objects"
    # a finished grammar ends the request at once: "stop", no EOS step spent
    assert {o.finish_reason for out in done.values() for o in out.outputs} == {"stop"}
    assert_all_blocks_free(engine)


@pytest.mark.slow
def test_same_seed_same_output_and_unconstrained_output_differs(engine):
    engine.add_request("a", "Hello", _constrained(5, Structured(json=SCHEMA)))
    engine.add_request("b", "Hello", _constrained(5, Structured(json=SCHEMA)))
    engine.add_request("free", "Hello", SamplingParams(temperature=1.0, seed=5, max_tokens=20))
    done = run(engine)
    assert done["a"].outputs[0].text == done["b"].outputs[0].text
    with pytest.raises(json.JSONDecodeError):
        json.loads(done["free"].outputs[0].text)


@pytest.mark.slow
def test_n_samples_logprobs_and_prefix_caching_keep_the_constraint(tiny_model):
    engine = make_engine(tiny_model, enable_prefix_caching=True)
    prompt = "A long shared prompt that fills a few blocks of the cache. " * 4
    params = _constrained(1, Structured(json=SCHEMA), n=3, logprobs=2)
    engine.add_request("first", prompt, params)
    first = run(engine)["first"]
    engine.add_request("again", prompt, params)
    again = run(engine)["again"]
    assert again.metrics.num_cached_tokens > 0
    for out in (first, again):
        assert len(out.outputs) == 3
        for o in out.outputs:
            jsonschema.validate(json.loads(o.text), SCHEMA)
            assert len(o.logprobs) == len(o.token_ids) and all(
                lp[o.token_ids[i]] <= 0.0 for i, lp in enumerate(o.logprobs)
            )
    assert [o.text for o in first.outputs] == [o.text for o in again.outputs]
    assert_all_blocks_free(engine)


def test_tokens_report_how_much_the_grammar_allowed(engine):
    log = EventLog(engine)
    engine.add_request("c", "Hello", _constrained(0, Structured(choice=CHOICES)))
    engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=4))
    run(engine)
    constrained = [e for e in log.of(ev.TokenGenerated) if e.request_id == "c"]
    free = [e for e in log.of(ev.TokenGenerated) if e.request_id == "free"]
    assert constrained and all(0 < e.allowed_fraction < 0.01 for e in constrained)
    assert all(e.allowed_fraction is None for e in free)
    arrived = next(e for e in log.of(ev.RequestArrived) if e.request_id == "c")
    assert arrived.sampling["structured_outputs"] == "choice"


def test_a_grammar_from_lark_or_gbnf(engine):
    engine.add_request("lark", "Hi", _constrained(0, Structured(grammar='start: "ab" NUM\nNUM: /[0-9]{2}/')))
    engine.add_request("gbnf", "Hi", _constrained(0, Structured(grammar='root ::= ("x" | "y") "!"')))
    done = run(engine)
    assert re.fullmatch(r"ab[0-9]{2}", done["lark"].outputs[0].text)
    assert done["gbnf"].outputs[0].text in ("x!", "y!")


@pytest.mark.parametrize(
    "structured, message",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "invalid JSON schema"),
        (dict(regex="[a-"), "invalid regular expression"),
        (dict(grammar="start: missing_rule"), "invalid grammar"),
        (dict(grammar="root ::= undefined"), "invalid grammar"),
    ],
)
def test_a_bad_grammar_is_refused_and_the_engine_keeps_serving(engine, structured, message):
    engine.add_request("ok", "Hello", SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(RequestRejectedError, match=message) as refused:
        engine.add_request("bad", "Hello", _constrained(0, Structured(**structured)))
    assert refused.value.param == "structured_outputs"
    assert "bad" not in engine.requests
    assert run(engine)["ok"].outputs[0].finish_reason == "length"
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    "structured, message",
    [
        (dict(choice=[]), "the list of choices is empty"),
        (dict(), "exactly one of"),
        (dict(regex="a", choice=["a"]), "exactly one of"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json="[1, 2]"), "must be a JSON object"),
    ],
)
def test_malformed_constraints_name_what_is_wrong(structured, message):
    with pytest.raises(ValueError, match=message):
        Structured(**structured)


def test_beam_search_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="structured_outputs cannot be combined with beam search"):
        SamplingParams(use_beam_search=True, n=2, structured_outputs=Structured(regex="a"))


def test_speculative_decoding_leaves_constrained_requests_undrafted(tiny_model):
    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.spec_decode.config import SpeculativeConfig

    prompt = "one two three one two three one two three one two"
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=Structured(regex="[a-z ]{5,30}"))
    plain = make_engine(tiny_model)
    plain.add_request("r", prompt, params)
    expected = run(plain)["r"].outputs[0].text
    spec = LLMEngine(
        tiny_model,
        EngineConfig(num_blocks=64, metrics_interval_s=3600.0),
        speculative=SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}'),
    )
    log = EventLog(spec)
    spec.add_request("r", prompt, params)
    spec.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=40))
    done = run(spec)
    assert done["r"].outputs[0].text == expected and re.fullmatch("[a-z ]{5,30}", expected)
    verified = {e.request_id for e in log.of(ev.SpecVerified)}
    assert "r" not in verified and "free" in verified  # the other request still speculates


def test_logit_bias_bans_and_forces_tokens(engine):
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=6))
    plain = run(engine)["plain"].outputs[0].token_ids
    banned = plain[0]
    engine.add_request("ban", "Hello", SamplingParams(temperature=0, max_tokens=6, logit_bias={banned: -100}))
    engine.add_request("force", "Hello", SamplingParams(temperature=0, max_tokens=6, logit_bias={"77": 100}))
    engine.add_request(
        "sampled", "Hello", SamplingParams(temperature=1.0, seed=0, max_tokens=6, logit_bias={"77": 100})
    )
    done = run(engine)
    assert banned not in done["ban"].outputs[0].token_ids
    assert done["force"].outputs[0].token_ids == [77] * 6
    assert done["sampled"].outputs[0].token_ids == [77] * 6
    # the reported logprobs stay the model's own: the bias is a sampling choice
    engine.add_request("lp", "Hello", SamplingParams(temperature=0, max_tokens=1, logprobs=0, logit_bias={77: 100}))
    assert run(engine)["lp"].outputs[0].logprobs[0][77] < -1.0


def test_logit_bias_is_checked(engine):
    with pytest.raises(RequestRejectedError, match="out of range for vocabulary size") as refused:
        engine.add_request("r", "Hello", SamplingParams(logit_bias={10**7: 5}))
    assert refused.value.param == "logit_bias"
    for bad, message in [({1: 101}, r"in \[-100, 100\]"), ({"x": 1}, "token ids"), ({1: float("nan")}, "-100")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(logit_bias=bad)


def test_building_the_grammar_tokenizer_hands_its_temporaries_back_once(tiny_model, monkeypatch):
    """llguidance's tokenizer is built from a serialised copy of the whole tokenizer; under the engine's
    malloc settings (kept for reuse) that freed memory stayed resident (~46 MiB measured): the first
    grammar trims the heap, later ones (the tokenizer is kept) do not."""
    from minivllm.structured import grammar

    trims = []
    monkeypatch.setattr(grammar, "release_free_heap", lambda: trims.append(1) or True)
    compiler = grammar.GrammarCompiler(tiny_model.tokenizer, tiny_model.config.vocab_size)
    compiler.compile(Structured(json={"type": "object"}))
    compiler.compile(Structured(regex="[ab]+"))
    assert trims == [1]


def test_the_grammar_cache_is_bounded_by_estimated_memory_and_gives_the_heap_back(tiny_model, monkeypatch):
    """Compiled grammars are kept by least recent use within CACHE_BYTES (estimated from each
    constraint's length: a 15,000-choice grammar held 8.7 MiB, and 256 such entries ~2 GiB); the newest
    stays even when it alone is over; evicted memory goes back to the OS in batches."""
    from minivllm.structured import grammar

    trims = []
    monkeypatch.setattr(grammar, "release_free_heap", lambda: trims.append(1) or True)
    compiler = grammar.GrammarCompiler(tiny_model.tokenizer, tiny_model.config.vocab_size)
    compiler.compile(Structured(regex="[ab]+"))  # builds the tokenizer (one trim of its own)
    trims.clear()
    choices = [Structured(choice=[f"option {i:02d}-{j:03d}" for j in range(400)]) for i in range(12)]
    one = grammar.estimated_bytes(choices[0].cache_key)
    monkeypatch.setattr(grammar, "CACHE_BYTES", 4 * one)
    monkeypatch.setattr(grammar, "TRIM_AFTER_BYTES", 3 * one)
    for params in choices:
        compiler.compile(params)
        assert compiler.cached_bytes <= grammar.CACHE_BYTES
    kept = list(compiler._cache)
    assert len(kept) == 4 and kept[-1] == choices[-1].cache_key and choices[0].cache_key not in kept
    assert compiler.compile(choices[-2]) is compiler._cache[choices[-2].cache_key]  # still cached: no recompile
    assert len(trims) == 2  # 8 or 9 evicted (the small regex among them): two batches of 3
    monkeypatch.setattr(grammar, "CACHE_BYTES", one // 2)
    compiler.compile(Structured(choice=[f"x{j}" for j in range(1000)]))
    assert len(compiler._cache) == 1  # the newest stays though it alone is over the bound


def test_a_finished_request_lets_its_grammar_go_once_the_cache_does(engine):
    """Finished requests stay for snapshots; their compiled grammar must not: once the cache evicts it,
    nothing keeps it alive (256 kept requests held ~7 MiB each under an attack of new constraints)."""
    import gc
    import weakref

    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=4, structured_outputs=Structured(choice=["red", "blue"])
    )
    engine.add_request("a", "Hello", params)
    assert run(engine)["a"].outputs[0].text in ("red", "blue")
    (finished,) = engine.tracker.finished
    assert finished.grammar is None and all(s.grammar is None for s in finished.all_seqs())
    compiled = weakref.ref(engine.grammars.compile(params.structured_outputs))
    engine.grammars._cache.clear()
    gc.collect()
    assert compiled() is None
