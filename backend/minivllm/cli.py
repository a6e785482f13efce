"""`minivllm` command line: generate, chat, serve, bench, replay, schema."""

from __future__ import annotations

import argparse
import os
import sys

from minivllm.engine_args import add_model_args, build_engine
from minivllm.env import says_yes


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--seed-sampling", dest="sampling_seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    from minivllm.sampling.params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from minivllm.cli_chat import stream_one

    engine = build_engine(args)
    prompt_ids = None
    if args.chat_template:
        from minivllm.text.tokenizer_utils import load_chat_template_prompt

        prompt_ids = load_chat_template_prompt(engine.tokenizer, [{"role": "user", "content": args.prompt}])
    stream_one(engine, args.prompt, prompt_ids, sampling_params(args))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from minivllm.cli_chat import interactive_chat

    interactive_chat(build_engine(args), sampling_params(args), system=args.system)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from minivllm.engine.tp_workers import torchrun_worker
    from minivllm.server.main import serve

    if args.tensor_parallel_size > 1 and torchrun_worker():  # a rank above 0 serves steps, not HTTP
        build_engine(args)  # returns only by SystemExit, once rank 0 closes
    if args.data_parallel_size > 1:
        return serve(args, replicas_builder(args))
    return serve(args, lambda: build_engine(args))


def replicas_builder(args: argparse.Namespace):
    """What launches the engine replicas on Ray (in the server's loading thread). Ray is joined here,
    on the main thread before the server starts: without Ray, the error says how to install it."""
    from minivllm.engine.api import ReplicaSet, connect_ray

    connect_ray(args.ray_address, args.data_parallel_size)
    size, address, routing = args.data_parallel_size, args.ray_address, args.routing
    return lambda: ReplicaSet.launch(size, lambda: build_engine(args), address, routing)


def cmd_bench(args: argparse.Namespace) -> int:
    from minivllm.bench import run_bench

    return run_bench(args)


def cmd_replay(args: argparse.Namespace) -> int:
    from minivllm.events.recording import print_summary

    print_summary(args.file)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from minivllm.schema import write_schema

    path = write_schema(args.output)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate a completion for one prompt (streams to stdout)")
    p.add_argument("prompt")
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user chat message")
    add_model_args(p), add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    p.add_argument("--system", default=None, help="system prompt")
    add_model_args(p), add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible API + dashboard")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this bearer key (or set MINIVLLM_API_KEY)")
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="another site allowed to call the API and open the event WebSocket (repeatable)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="a Host name to answer besides localhost/127.0.0.1 (repeatable; a DNS-rebinding guard)",
    )
    p.add_argument("--recordings-dir", default="recordings")
    p.add_argument(
        "--recordings-quota",
        default="2GiB",
        help="the recordings folder's size limit; the oldest recordings are deleted to make room",
    )
    p.add_argument("--frontend-dist", default=None, help="built dashboard to serve (default: frontend/dist)")
    p.add_argument(
        "--ws-queue-limit",
        type=int,
        default=20_000,
        help="events buffered per WebSocket client before it gets a resync and a fresh snapshot",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a Jinja `chat_template` in chat requests (a template can run for long: trusted "
        "clients only, as vLLM's flag of the same name)",
    )
    p.add_argument(
        "--embedding-pooling",
        default="last",
        choices=["last", "mean"],
        help="/v1/embeddings: the last token's final hidden state (vLLM's default for decoder models) "
        "or the mean over all tokens",
    )
    p.add_argument(
        "--data-parallel-size",
        type=at_least_one,
        default=1,
        help="engine replicas, each a Ray actor with its own model and KV pool; requests go to the replica "
        "holding their prompt's prefix (needs `pip install 'minivllm[ray]'`)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (`auto`: the one `ray start` runs here) instead of starting a local one",
    )
    p.add_argument(
        "--routing",
        default="prefix",
        choices=["prefix", "round_robin"],
        help="how requests are spread over replicas: by cached prefix (least loaded without one), or in turn",
    )
    add_model_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="benchmarks that print comparisons side by side")
    p.add_argument(
        "kind",
        choices=[
            "single",
            "throughput",
            "profile",
            "quality",
            "llamacpp",
            "spec",
            "structured",
            "compile",
            "pages",
            "sampler",
            "serve",
            "ablation",
            "kv",
        ],
    )
    p.add_argument(
        "--draft-model", default=None, help="spec: the draft model's spec (default: the embedded model, in int4)"
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="METHOD",
        help="spec: run only these methods (ngram, draft, early); 'off' always runs",
    )
    p.add_argument("--output-dir", default="bench-results")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 128; serve: 64)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per run (default: the concurrency)")
    p.add_argument("--skip-hf", action="store_true", help="do not run the Hugging Face baselines")
    p.add_argument(
        "--skip-fp32",
        action="store_true",
        help="single: do not run the fp32-weights baseline next to a quantized engine",
    )
    p.add_argument("--quick", action="store_true", help="fewer tokens and prompts (smoke test)")
    p.add_argument("--json", action="store_true", help="ablation: print the results as JSON on stdout")
    p.add_argument(
        "--prompt-tokens",
        type=at_least_one,
        default=None,
        help="llamacpp: every prompt exactly this many tokens (the chat prompts repeated), to compare "
        "decode at a long context (default: the chat prompts as they are, ~40 tokens); "
        "serve: each prompt's length (default 128)",
    )
    p.add_argument(
        "--rounds",
        type=at_least_one,
        default=3,
        help="llamacpp, serve, ablation: runs of each side per level, alternating; the table shows medians "
        "(llamacpp: and the per-round ratios' range) (--quick: 1)",
    )
    add_model_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("replay", help="summarise a recording (JSONL)")
    p.add_argument("file")
    p.add_argument("--summary", action="store_true", default=True)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("schema", help="write the JSON Schema of every wire type")
    p.add_argument("--output", default=None, help="default: shared/events.schema.json in the repo")
    p.set_defaults(func=cmd_schema)
    return parser


def at_least_one(text: str) -> int:
    """An option's whole number of 1 or more (argparse: a bad one is a usage error before anything loads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def apply_env_defaults(parser: argparse.ArgumentParser, environ=None) -> None:
    """Every option can also come from the environment as MINIVLLM_<OPTION> (docker compose)."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_env_defaults(sub, environ)
            continue
        long = next((o for o in action.option_strings if o.startswith("--")), None)
        value = environ.get("MINIVLLM_" + long[2:].upper().replace("-", "_"), "") if long else ""
        if not value:
            continue
        if action.nargs == 0:  # store_true flags
            action.default = says_yes(value)
        elif isinstance(action, argparse._AppendAction):
            action.default = [v for v in value.split(",") if v]
        else:
            action.default = action.type(value) if action.type else value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    apply_env_defaults(parser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
