"""Soak test (`make soak`, not in CI): a real `minivllm serve` under C concurrent streams for N
minutes, with clients that read everything, hang up part-way, or read slowly. Every 15 s it prints
the server's RSS, KV usage and the outcome counts; at the end it waits for the engine to go idle and
checks that no KV block is still referenced. Writes a JSON summary and an RSS plot; exits 1 on any
error, leaked block, or (with --attack) an RSS peak over --max-rss-gib.

--attack turns half the streams hostile (scripts/soak_attacks.py: new large grammars every request,
tools near the prompt-size bound, malformed fields and bodies); those may get any 2xx or 4xx.

    python scripts/soak.py --minutes 5 --streams 16 [--attack] [--model PATH] [--out bench-results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from soak_attacks import MALFORMED_BODIES, attack_body

PROMPTS = [
    "Explain continuous batching.",
    "Write a haiku about a cache miss.",
    "What is a paged KV cache?",
    "Summarise Hamlet in two sentences.",
    "Why is the sky blue?",
    "List three uses of prefix caching.",
]
SAMPLE_EVERY_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, model: str | None) -> subprocess.Popen:
    minivllm = str(Path(sys.executable).with_name("minivllm"))
    cmd = [minivllm, "serve", "--port", str(port), "--log-level", "warning", "--recordings-dir", "/tmp/soak-recordings"]
    if model:
        cmd += ["--model", model]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def wait_healthy(client: httpx.AsyncClient, proc: subprocess.Popen) -> None:
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} while loading")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        print(f"\r[soak] loading the model … {time.monotonic() - start:.0f} s", end="", flush=True)
        await asyncio.sleep(1.0)


async def one_request(client: httpx.AsyncClient, rng: random.Random, outcomes: Counter) -> None:
    behaviour = rng.choices(["full", "hang-up", "slow"], weights=[6, 2, 2])[0]
    chat = rng.random() < 0.5
    body = {
        "max_tokens": rng.randint(16, 96),
        "temperature": rng.choice([0, 0.8]),
        "n": rng.choice([1, 1, 2]),
        "stream": True,
        **(
            {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
            if chat
            else {"prompt": rng.choice(PROMPTS)}
        ),
    }
    path = "/v1/chat/completions" if chat else "/v1/completions"
    finish, chunks, stop_after = 0, 0, rng.randint(1, 8)
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                outcomes[f"error {r.status_code}"] += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    outcomes["error chunk"] += 1
                    return
                chunks += 1
                finish += sum(1 for c in data.get("choices", []) if c.get("finish_reason"))
                if behaviour == "hang-up" and chunks >= stop_after:
                    outcomes["hung up"] += 1
                    return
                if behaviour == "slow":
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
    except httpx.HTTPError as exc:
        outcomes[f"error {type(exc).__name__}"] += 1
        return
    if finish != body["n"]:
        outcomes["error: missing finish_reason"] += 1
    else:
        outcomes["completed (slow reader)" if behaviour == "slow" else "completed"] += 1


async def one_attack(client: httpx.AsyncClient, rng: random.Random, outcomes: Counter) -> None:
    """A hostile request: any 2xx or 4xx is fine (counted by attack), a 5xx or a dropped connection is an error."""
    if rng.random() < 0.1:
        name, kwargs = "malformed body", {"content": rng.choice(MALFORMED_BODIES)}
    else:
        name, body = attack_body(rng)
        kwargs = {"json": body}
    try:
        r = await client.post("/v1/chat/completions", headers={"content-type": "application/json"}, **kwargs)
    except httpx.HTTPError as exc:
        outcomes[f"error {type(exc).__name__} ({name})"] += 1
        return
    outcomes[f"error {r.status_code} ({name})" if r.status_code >= 500 else f"attack {r.status_code // 100}xx"] += 1


async def worker(client: httpx.AsyncClient, seed: int, deadline: float, outcomes: Counter, hostile: bool) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        await (one_attack if hostile else one_request)(client, rng, outcomes)


async def sample(client: httpx.AsyncClient) -> dict:
    text = (await client.get("/metrics")).text
    rss = float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M).group(1))
    kv = re.search(r"^minivllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)
    return {"rss_gib": rss / 2**30, "kv_usage": float(kv.group(1)) if kv else 0.0}


async def monitor(client: httpx.AsyncClient, start: float, deadline: float, outcomes: Counter, series: list) -> None:
    while time.monotonic() < deadline:
        s = await sample(client) | {"t_s": time.monotonic() - start}
        series.append(s)
        counts = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "nothing yet"
        print(f"[soak] {s['t_s']:5.0f} s  RSS {s['rss_gib']:.2f} GiB  KV {s['kv_usage']:.0%}  {counts}", flush=True)
        await asyncio.sleep(SAMPLE_EVERY_S)


async def leaked_blocks(client: httpx.AsyncClient) -> tuple[int, int]:
    """(blocks still referenced, requests still live) once the engine is idle (waits up to 60 s)."""
    for _ in range(120):
        state = (await client.get("/api/state")).json()
        live = [r for r in state["requests"] if r["state"] not in ("FINISHED", "ABORTED")]
        if not live:
            return sum(1 for b in state["blocks"] if b["ref_count"] > 0), 0
        await asyncio.sleep(0.5)
    return sum(1 for b in state["blocks"] if b["ref_count"] > 0), len(live)


async def soak(args: argparse.Namespace) -> dict:
    port = free_port()
    proc = start_server(port, args.model)
    limits = httpx.Limits(max_connections=args.streams + 4)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits) as client:
            await wait_healthy(client, proc)
            hostile = args.streams // 2 if args.attack else 0
            print(
                f"\n[soak] {args.streams} streams ({hostile} hostile) for {args.minutes:g} min against "
                f"http://127.0.0.1:{port}"
            )
            outcomes: Counter = Counter()
            series: list[dict] = []
            start = time.monotonic()
            deadline = start + 60 * args.minutes
            await asyncio.gather(
                monitor(client, start, deadline, outcomes, series),
                *(worker(client, seed, deadline, outcomes, seed < hostile) for seed in range(args.streams)),
            )
            leaked, live = await leaked_blocks(client)
            series.append(await sample(client) | {"t_s": time.monotonic() - start})
    finally:
        proc.terminate()
        proc.wait(30)
    errors = sum(v for k, v in outcomes.items() if k.startswith("error"))
    return {
        "minutes": args.minutes,
        "streams": args.streams,
        "attack": args.attack,
        "outcomes": dict(outcomes),
        "errors": errors,
        "leaked_blocks": leaked,
        "live_requests_at_end": live,
        "rss_gib_first": series[0]["rss_gib"],
        "rss_gib_peak": max(s["rss_gib"] for s in series),
        "rss_gib_last": series[-1]["rss_gib"],
        "series": series,
    }


def report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([s["t_s"] for s in result["series"]], [s["rss_gib"] for s in result["series"]], marker=".")
    ax.set(
        xlabel="seconds",
        ylabel="server RSS (GiB)",
        title=f"soak{' (attack)' if result['attack'] else ''}: {result['streams']} streams, "
        f"{result['minutes']:g} min, {result['errors']} errors, {result['leaked_blocks']} leaked blocks",
    )
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out / "soak_rss.png", dpi=120)
    o = result["outcomes"]
    print(
        "\n| minutes | streams | attack | completed | of them slow readers | hung up | errors | leaked blocks "
        "| RSS first / peak / last (GiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    slow = o.get("completed (slow reader)", 0)
    print(
        f"| {result['minutes']:g} | {result['streams']} | {sum(v for k, v in o.items() if k.startswith('attack'))} "
        f"| {o.get('completed', 0) + slow} | {slow} "
        f"| {o.get('hung up', 0)} | {result['errors']} | {result['leaked_blocks']} "
        f"| {result['rss_gib_first']:.2f} / {result['rss_gib_peak']:.2f} / {result['rss_gib_last']:.2f} |"
    )
    print(f"[soak] wrote {out / 'soak.json'} and {out / 'soak_rss.png'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--attack", action="store_true", help="half the streams send hostile requests")
    parser.add_argument(
        "--max-rss-gib", type=float, default=1.25, help="with --attack: the RSS peak the server must stay under"
    )
    args = parser.parse_args()
    result = asyncio.run(soak(args))
    report(result, Path(args.out))
    over = args.attack and result["rss_gib_peak"] > args.max_rss_gib
    if over:
        print(f"[soak] RSS peaked at {result['rss_gib_peak']:.2f} GiB, over the {args.max_rss_gib:g} GiB limit")
    return 1 if result["errors"] or result["leaked_blocks"] or result["live_requests_at_end"] or over else 0


if __name__ == "__main__":
    sys.exit(main())
