"""Building the speculator an engine runs: the proposer for the configured method, and for a
draft model its own KV pool. Loading the draft model and checking it against the target
(same vocabulary) also happens here."""

from __future__ import annotations

from minivllm.arith import ceil_div
from minivllm.core.block_manager import BlockManager
from minivllm.errors import ConfigError
from minivllm.loader import LoadedModel, load_model
from minivllm.model.attention import KVCache
from minivllm.model.compiled import use_compilation
from minivllm.spec_decode.config import PARAM, SpeculativeConfig
from minivllm.spec_decode.proposers import DraftModelProposer, EarlyExitProposer, NgramProposer
from minivllm.spec_decode.runner import RunnerFactory, StepRunner
from minivllm.spec_decode.speculator import Proposer, Speculator


def load_draft(spec: SpeculativeConfig, target: LoadedModel, max_model_len: int | None) -> LoadedModel | None:
    """The draft model of a draft_model config (None for the other methods), checked to share the
    target's vocabulary: drafts are token ids, so both must mean the same thing by each id."""
    if spec.method != "draft_model":
        return None
    draft = load_model(
        spec.model,
        dtype=target.dtype,
        device=str(target.device),
        max_model_len=max_model_len,
        quantization=spec.quantization,
    )
    check_same_vocabulary(target, draft)
    # a draft decodes one row a step, where the compiled step pays most; it runs as its target does
    use_compilation(draft.model, draft.device, enforce_eager=not (target.model.may_compile or target.model.may_capture))
    return draft


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    t_vocab, d_vocab = target.config.vocab_size, draft.config.vocab_size
    if t_vocab != d_vocab:
        raise ConfigError(
            f"draft model {draft.name} has a vocabulary of {d_vocab} tokens but the target "
            f"{target.name} has {t_vocab}: they must share one tokenizer",
            PARAM,
        )
    if (
        target.tokenizer is not None
        and draft.tokenizer is not None
        and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab()
    ):
        raise ConfigError(
            f"draft model {draft.name} and target {target.name} have different tokenizers "
            "(same size, different tokens): drafts would mean other words",
            PARAM,
        )


def build_speculator(
    spec: SpeculativeConfig,
    runner: StepRunner,
    block_manager: BlockManager,
    draft: LoadedModel | None,
    max_model_len: int,
    new_runner: RunnerFactory,
) -> Speculator:
    """`new_runner` builds the draft model's runner (the engine passes its runner class)."""
    proposer = _proposer(spec, runner, block_manager, draft, max_model_len, new_runner)
    return Speculator(spec, proposer, max_model_len)


def _proposer(
    spec: SpeculativeConfig,
    runner: StepRunner,
    block_manager: BlockManager,
    draft: LoadedModel | None,
    max_model_len: int,
    new_runner: RunnerFactory,
) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "early_exit":
        spec.check_exit_layer(runner.model.config.num_hidden_layers)
        return EarlyExitProposer(runner, block_manager, spec.exit_layer)
    if draft is None:
        raise ConfigError("a draft_model config needs its draft model loaded (spec.factory.load_draft)", PARAM)
    return DraftModelProposer(*_draft_pool(draft, block_manager, spec, max_model_len, new_runner))


def _draft_pool(
    draft: LoadedModel,
    target_blocks: BlockManager,
    spec: SpeculativeConfig,
    max_model_len: int,
    new_runner: RunnerFactory,
) -> tuple[StepRunner, BlockManager]:
    """Room for as many full-length sequences as speculation runs for at most, never more blocks
    than the target's pool (the draft is at most as large as the target). Pages are touched only
    when written, so unused room costs no resident memory."""
    bs, cfg = target_blocks.block_size, draft.config
    seqs = spec.disable_by_batch_size or 8
    num_blocks = min(target_blocks.num_blocks, seqs * ceil_div(max_model_len, bs))
    kv = KVCache(
        cfg.num_hidden_layers,
        num_blocks,
        bs,
        cfg.num_key_value_heads,
        cfg.head_dim,
        draft.dtype,
        draft.device,
        scratch_block=draft.model.may_capture,
    )
    runner = new_runner(draft.model, kv).warmed_up(seqs, max_model_len)
    return runner, BlockManager(num_blocks, bs, enable_prefix_caching=False, record_events=False)
