"""The dashboard's "Run ablation" button: `minivllm bench ablation --quick --json` on the served model,
in a subprocess (it loads the model once per configuration, so it never touches the serving engine),
one run at a time. POST starts it (409 while one runs), GET reports its progress and its result."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tempfile
from dataclasses import dataclass, field

import msgspec
from litestar import Request, Router, get, post

from minivllm.server.auth import require_api_key
from minivllm.server.errors import APIError, decode_body

PROGRESS = re.compile(r"\[bench\] round \d+/\d+, (\d+)/(\d+) (.*)")
MAX_PROMPTS, MAX_TOKENS = 8, 32  # a quick run: seconds per configuration, not minutes


class AblationRequest(msgspec.Struct, forbid_unknown_fields=True):
    num_prompts: int = 4
    max_tokens: int = 8


class AblationStatus(msgspec.Struct):
    """state: unavailable (a server built in-process: see ServerConfig.enable_ablation), idle, running,
    done or failed. done/total: configurations finished; result: the
    benchmark's JSON report (rows with tokens/s and ratios to all on) once done."""

    state: str
    done: int = 0
    total: int = 0
    current: str | None = None
    result: dict | None = None
    error: str | None = None


@dataclass
class AblationRunner:
    model: str | None  # the served model's spec (None: the embedded one)
    enabled: bool
    status: AblationStatus = field(init=False)
    process: asyncio.subprocess.Process | None = None

    def __post_init__(self) -> None:
        self.status = AblationStatus("idle" if self.enabled else "unavailable")

    def start(self, req: AblationRequest) -> AblationStatus:
        if not self.enabled:
            raise APIError(
                404,
                "ablation runs need a server started by `minivllm serve` (it knows the model spec)",
                code="ablation_unavailable",
            )
        if self.status.state == "running":
            raise APIError(409, "an ablation run is already in progress", code="ablation_running")
        self.status = AblationStatus("running")
        asyncio.get_running_loop().create_task(self._run(req))
        return self.status

    async def _run(self, req: AblationRequest) -> None:
        with tempfile.TemporaryDirectory(prefix="minivllm-ablation-") as out_dir:
            cmd = [sys.executable, "-m", "minivllm.cli", "bench", "ablation", "--quick", "--json"]
            cmd += ["--num-prompts", str(req.num_prompts), "--max-tokens", str(req.max_tokens)]
            cmd += ["--output-dir", out_dir] + (["--model", self.model] if self.model else [])
            try:
                self.process = await asyncio.create_subprocess_exec(
                    *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
                )
                tail = await self._follow(self.process.stderr)
                stdout = await self.process.stdout.read()
                if await self.process.wait() != 0:
                    raise RuntimeError("\n".join(tail) or f"exit status {self.process.returncode}")
                self.status = AblationStatus("done", self.status.total, self.status.total, result=json.loads(stdout))
            except Exception as exc:  # reported to the dashboard, never raised into the server
                self.status = AblationStatus("failed", self.status.done, self.status.total, error=str(exc)[-2000:])
            finally:
                self.process = None

    async def _follow(self, stream) -> list[str]:
        """Moves the progress from the benchmark's "[bench] ..." lines; returns the last lines."""
        tail: list[str] = []
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            tail = (tail + [line])[-20:]
            m = PROGRESS.match(line)
            if m:
                done, total = int(m.group(1)) - 1, int(m.group(2))
                self.status = AblationStatus("running", done, total, current=m.group(3))
        return tail

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


def runner_of(request: Request) -> AblationRunner:
    return request.app.state.ablation


@post("/ablation", status_code=202, summary="Start a quick ablation benchmark (409 while one runs)")
async def start_ablation(request: Request) -> AblationStatus:
    body = await request.body()
    req = decode_body(body, AblationRequest) if body.strip() else AblationRequest()
    for name, value, most in (
        ("num_prompts", req.num_prompts, MAX_PROMPTS),
        ("max_tokens", req.max_tokens, MAX_TOKENS),
    ):
        if not 1 <= value <= most:
            raise APIError(400, f"{name} must be between 1 and {most}, got {value}", param=name)
    return runner_of(request).start(req)


@get("/ablation", summary="The ablation run's progress, and its result once done")
async def ablation_status(request: Request) -> AblationStatus:
    return runner_of(request).status


def ablation_router() -> Router:
    return Router(
        "/api", route_handlers=[start_ablation, ablation_status], guards=[require_api_key], tags=["Dashboard API"]
    )
