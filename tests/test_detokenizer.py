"""IncrementalDetokenizer: streamed deltas must add up to the full decode."""

from __future__ import annotations

import random

import pytest
from _tokenizers import (
    BYTE_TOKENS,
    CORPUS,
    smollm2_tokenizer,
    sp_bpe_tokenizer,
    sp_unigram_tokenizer,
)

from minivllm.text.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer

FFFD = "\ufffd"

REAL_TEXTS = [
    "Hello, world! This is a streaming test.",
    " leading space and  double  spaces\tand tabs\n\nnew paragraphs",
    "héllo wörld naïve café résumé déjà vu",
    "日本語のテキストです。中文也可以。한국어도 됩니다.",
    "emoji: 🙂🚀🎉👍🏽 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code ✓ → ∑ ∞",
    "Mixed: Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย",
    "",
    "   ",
    "🙂",
]


@pytest.fixture(scope="module")
def smol():
    return smollm2_tokenizer()


@pytest.fixture(scope="module", params=["sp_bpe", "sp_unigram"])
def sp_tok(request):
    return {"sp_bpe": sp_bpe_tokenizer, "sp_unigram": sp_unigram_tokenizer}[request.param]()


def stream(tok, prompt, ids, skip=True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.append(t) for t in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail, detok


# ---------------------------------------------------------------- byte-level BPE (SmolLM2)


@pytest.mark.slow
@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_text_deltas_equal_full_decode(smol, text):
    ids = smol.encode(text, add_special_tokens=False)
    prompt = smol.encode("Write something:", add_special_tokens=False)
    deltas, tail, detok = stream(smol, prompt, ids)
    assert detok.text == smol.decode(ids, skip_special_tokens=True) == text
    assert tail == ""
    assert not any(FFFD in d for d in deltas)


def test_multibyte_chars_split_over_tokens_are_held_back(smol):
    text = "a 日本語 🙂 b👨‍👩‍👧‍👦c"
    ids = smol.encode(text, add_special_tokens=False)
    # The test is only meaningful if some single tokens are partial characters.
    assert any(FFFD in smol.decode([t]) for t in ids)
    deltas, tail, detok = stream(smol, [], ids)
    assert "" in deltas  # something was held back for a while
    assert not any(FFFD in d for d in deltas)
    assert detok.text == text and tail == ""
    # Every prefix of the stream is a prefix of the final text.
    acc = ""
    for d in deltas:
        acc += d
        assert text.startswith(acc)


def test_chat_prompt_context_and_special_tokens(smol):
    from minivllm.text.tokenizer_utils import load_chat_template_prompt

    prompt = load_chat_template_prompt(smol, [{"role": "user", "content": "Say hi"}])
    out = smol.encode(" Hi there! 👋 How can I help?", add_special_tokens=False)
    out = out + [smol.convert_tokens_to_ids("<|im_end|>")]
    for skip in (True, False):
        _, _, detok = stream(smol, prompt, out, skip=skip)
        assert detok.text == smol.decode(out, skip_special_tokens=skip)
    assert detok.text.endswith("<|im_end|>")


def test_special_tokens_mid_stream(smol):
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    eot = smol.convert_tokens_to_ids("<|endoftext|>")
    ids = smol.encode("one", add_special_tokens=False) + [im_end, eot]
    ids += smol.encode(" two 日本", add_special_tokens=False)
    for skip in (True, False):
        deltas, _, detok = stream(smol, [], ids, skip=skip)
        assert detok.text == smol.decode(ids, skip_special_tokens=skip)
    assert detok.text == "one<|im_end|><|endoftext|> two 日本"


@pytest.mark.slow
def test_random_token_sequences_byte_level(smol):
    rng = random.Random(1234)
    vocab = len(smol)
    # tokens that are lone bytes / partial characters, to force UTF-8 splits
    partial = [t for t in range(vocab) if FFFD in smol.decode([t])][:300]
    specials = [0, 1, 2, 5]
    for _ in range(400):
        ids = []
        for _ in range(rng.randint(0, 40)):
            r = rng.random()
            ids.append(rng.choice(partial) if r < 0.3 else rng.choice(specials) if r < 0.35 else rng.randrange(vocab))
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        for skip in (True, False):
            _, _, detok = stream(smol, prompt, ids, skip=skip)
            assert detok.text == smol.decode(ids, skip_special_tokens=skip), (prompt, ids)


def test_random_real_text_splits(smol):
    """Concatenations of real encoded texts in random orders."""
    rng = random.Random(7)
    pieces = [smol.encode(t, add_special_tokens=False) for t in REAL_TEXTS + CORPUS if t]
    for _ in range(100):
        ids = [t for p in rng.sample(pieces, 4) for t in p]
        cut = rng.randrange(len(ids) + 1)
        prompt, out = ids[:cut], ids[cut:]
        deltas, _, detok = stream(smol, prompt, out)
        assert detok.text == smol.decode(out, skip_special_tokens=True)


def test_flush_emits_incomplete_utf8_at_end(smol):
    ids = smol.encode("ok 日本語", add_special_tokens=False)
    # stop in the middle of a character (as with max_tokens)
    cuts = [ids[:n] for n in range(1, len(ids)) if smol.decode(ids[:n]).endswith(FFFD)]
    assert cuts, "expected a character to span several tokens"
    cut = cuts[0]
    deltas, tail, detok = stream(smol, [], cut)
    assert not any(FFFD in d for d in deltas)
    assert FFFD in tail
    assert detok.text == smol.decode(cut)
    assert detok.flush() == ""  # nothing left


def test_window_stays_bounded(smol):
    text = " ".join(REAL_TEXTS) * 20
    ids = smol.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, [])
    for t in ids:
        detok.append(t)
        assert len(detok._ids) <= 2 * MAX_HELD_TOKENS
    detok.flush()
    assert detok.text == text
    # a long run of invalid bytes (orphan continuation bytes) is emitted, not held forever
    orphan = next(t for t in range(len(smol)) if smol.decode([t]) == FFFD)
    detok = IncrementalDetokenizer(smol, [])
    for _ in range(200):
        detok.append(orphan)
        assert len(detok._ids) <= 2 * MAX_HELD_TOKENS
    detok.flush()
    assert detok.text == smol.decode([orphan] * 200)


def test_extend_and_unknown_ids(smol):
    ids = smol.encode("abc def", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, None)
    assert detok.extend(ids) + detok.flush() == "abc def"
    assert detok.append(len(smol) + 10) == ""  # padded-vocab id: no text
    assert detok.num_tokens == len(ids) + 1


# ------------------------------------------------------- SentencePiece / Metaspace tokenizers


def test_sp_leading_space_of_first_output_token_kept(sp_tok):
    out = sp_tok.encode("hello world", add_special_tokens=False)
    assert sp_tok.convert_ids_to_tokens(out)[0].startswith("▁")
    prompt = sp_tok.encode("Say:", add_special_tokens=False)
    _, _, detok = stream(sp_tok, prompt, out)
    assert detok.text == " hello world"
    full, pre = sp_tok.decode(prompt + out), sp_tok.decode(prompt)
    assert detok.text == full[len(pre) :]
    # without context it matches a plain decode of the output (no leading space)
    _, _, detok = stream(sp_tok, [], out)
    assert detok.text == sp_tok.decode(out) == "hello world"
    # a prompt of only (skipped) special tokens behaves like decoding BOS + output
    bos = sp_tok.convert_tokens_to_ids("<s>")
    _, _, detok = stream(sp_tok, [bos], out)
    assert detok.text == sp_tok.decode([bos] + out, skip_special_tokens=True) == "hello world"


def test_sp_spaces_between_tokens_preserved(sp_tok):
    text = "the  quick   brown fox, héllo wörld"
    out = sp_tok.encode(text, add_special_tokens=False)
    prompt = sp_tok.encode("Prompt", add_special_tokens=False)
    deltas, _, detok = stream(sp_tok, prompt, out)
    assert detok.text == " " + text
    assert sum(d.count(" ") for d in deltas) == (" " + text).count(" ")


def test_sp_byte_fallback_no_partial_chars(sp_tok):
    text = "über 中文 🎉 ok ñ€"  # characters absent from the training corpus
    out = sp_tok.encode(text, add_special_tokens=False)
    byte_ids = set(sp_tok.convert_tokens_to_ids(BYTE_TOKENS))
    assert sum(t in byte_ids for t in out) >= 8, "expected byte-fallback tokens"
    deltas, tail, detok = stream(sp_tok, sp_tok.encode("x", add_special_tokens=False), out)
    assert not any(FFFD in d for d in deltas)
    assert detok.text == " " + text and tail == ""
    for skip in (True, False):
        _, _, detok = stream(sp_tok, [], out, skip=skip)
        assert detok.text == sp_tok.decode(out, skip_special_tokens=skip) == text


def test_sp_random_token_sequences(sp_tok):
    """Random mixes of normal tokens, special tokens and whole byte-fallback characters."""
    rng = random.Random(99)
    byte_ids = set(sp_tok.convert_tokens_to_ids(BYTE_TOKENS))
    normal = [i for i in range(len(sp_tok)) if i not in byte_ids]
    chars = "üñ中文🎉€ßøæ語の日👍🏽"

    def gen():
        ids = []
        for _ in range(rng.randint(0, 25)):
            if rng.random() < 0.3:
                c = rng.choice(chars)
                ids += sp_tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in c.encode()])
            else:
                ids.append(rng.choice(normal))
        return ids

    for _ in range(300):
        out = gen()
        r = rng.random()
        prompt = [] if r < 0.3 else gen() if r < 0.6 else sp_tok.encode(rng.choice(CORPUS))
        for skip in (True, False):
            deltas, _, detok = stream(sp_tok, prompt, out, skip=skip)
            assert not any(FFFD in d for d in deltas)
            full = sp_tok.decode(prompt + out, skip_special_tokens=skip)
            pre = sp_tok.decode(prompt, skip_special_tokens=skip)
            assert full.startswith(pre)
            assert detok.text == full[len(pre) :], (prompt, out)
            if not prompt:
                assert detok.text == sp_tok.decode(out, skip_special_tokens=skip)
