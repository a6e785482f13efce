"""Fixtures for the browser end-to-end tests.

One real server per test session (`minivllm serve` with the embedded model and a small KV pool, so
a handful of concurrent chats preempt each other), one headless system Chromium per session, and a
fresh browser context + page per test. Before and after every test the engine is put back to the
session's configuration with PUT /api/config, which also rebuilds the KV pool and forgets finished
requests: every test starts from an empty engine, whatever ran before it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, Page, expect, sync_playwright

from e2e_support import ARTIFACTS, INIT_SCRIPT, REPO

CHROMIUM = os.environ.get("MINIVLLM_E2E_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1600, "height": 1000}

# The session's engine. A chat here has a ~40-token prompt (the template's default system prompt
# plus the message), so 32-48 new tokens need 5-6 blocks: every single request fits in 16 blocks,
# four or more running together do not, and the scheduler has to preempt.
ENGINE = {
    "num_blocks": 16,
    "block_size": 16,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 8,
    "enable_prefix_caching": True,
    "kv_cache_dtype": "float32",
}

SERVER_START_TIMEOUT_S = 300
# Web-first assertions wait this long unless a test says otherwise (the box is shared and slow).
expect.set_options(timeout=30_000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _minivllm() -> str:
    here = Path(sys.executable).with_name("minivllm")
    if here.exists():
        return str(here)
    found = shutil.which("minivllm")
    if found is None:
        raise RuntimeError("the minivllm command is not installed (run make setup)")
    return found


@contextlib.contextmanager
def running_server(extra_args: list[str], log_name: str) -> Iterator[str]:
    """A `minivllm serve` with the session's engine settings plus `extra_args`; yields its base URL
    once healthy and stops it afterwards. Its output goes to artifacts/e2e/<log_name>."""
    # MINIVLLM_E2E_DIST: a build elsewhere (`vite build --outDir ...`), so parallel checkouts do not share one.
    dist = Path(os.environ.get("MINIVLLM_E2E_DIST", REPO / "frontend" / "dist"))
    if not (dist / "index.html").exists():
        pytest.fail("frontend/dist is missing: run `cd frontend && npm run build` first")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    cmd = [
        _minivllm(),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-blocks",
        str(ENGINE["num_blocks"]),
        "--block-size",
        str(ENGINE["block_size"]),
        "--max-num-seqs",
        str(ENGINE["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(ENGINE["max_num_batched_tokens"]),
        *extra_args,
        "--frontend-dist",
        str(dist),
        "--log-level",
        "warning",
    ]
    env = dict(os.environ)
    # One intra-op thread: on a small shared box, torch's default (one thread per core) competes
    # with the browser and other jobs and every engine step slows down by an order of magnitude.
    env.setdefault("OMP_NUM_THREADS", os.environ.get("MINIVLLM_E2E_THREADS", "1"))
    env.pop("MINIVLLM_API_KEY", None)
    log_path = ARTIFACTS / log_name
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode} while starting; see {log_path}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not healthy after {SERVER_START_TIMEOUT_S} s; see {log_path}")
            time.sleep(0.5)  # polling the health check (fixture setup, not a test)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    recordings = tmp_path_factory.mktemp("recordings")
    with running_server(["--recordings-dir", str(recordings)], "server.log") as base:
        yield base


@pytest.fixture(scope="session")
def api(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=httpx.Timeout(180, connect=10)) as client:
        yield client


def reset_engine(api: httpx.Client, timeout_s: float = 90) -> None:
    """PUT the session's engine configuration, waiting out 409s while aborted requests drain."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = api.put("/api/config", json=ENGINE)
        if r.status_code == 200:
            got = r.json()
            assert {k: got[k] for k in ENGINE} == ENGINE, got
            return
        if r.status_code != 409 or time.monotonic() > deadline:
            raise AssertionError(f"could not restore the engine configuration: {r.status_code} {r.text}")
        time.sleep(0.2)  # polling: the engine is still finishing (or aborting) requests


@pytest.fixture(autouse=True)
def engine(api: httpx.Client) -> Iterator[dict]:
    """Every test starts (and ends) with the session's engine: default settings, empty pool."""
    reset_engine(api)
    yield ENGINE
    reset_engine(api)


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set MINIVLLM_E2E_CHROMIUM)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def context(browser: Browser, server: str) -> Iterator[BrowserContext]:
    ctx = browser.new_context(base_url=server, viewport=VIEWPORT)
    ctx.add_init_script(INIT_SCRIPT)
    yield ctx
    ctx.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def page(context: BrowserContext, request: pytest.FixtureRequest, engine: dict) -> Iterator[Page]:
    """The dashboard, connected to the live event stream with the engine's snapshot applied."""
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # every test: no console error and no request the client gave up on (a successful stream read to its
    # end), except where a test provokes them on purpose and says so with its marker
    problems: list[str] = []
    if request.node.get_closest_marker("console_errors_expected") is None:
        pg.on("console", lambda m: problems.append(f"console error: {m.text}") if m.type == "error" else None)
    if request.node.get_closest_marker("aborts_requests") is None:
        pg.on("requestfailed", lambda r: problems.append(f"request failed: {r.method} {r.url} {r.failure}"))
    pg.goto("/")
    expect(pg.get_by_test_id("connection-badge")).to_have_attribute("data-status", "live")
    expect(pg.get_by_test_id("heatmap-summary")).to_contain_text(f"blocks={engine['num_blocks']} ")
    yield pg
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        out = ARTIFACTS / "failures"
        out.mkdir(parents=True, exist_ok=True)
        try:
            pg.screenshot(path=str(out / f"{request.node.name}.png"), full_page=True)
        except Exception:  # noqa: BLE001 - best effort: the page may be gone
            pass
    assert not errors, f"uncaught errors in the page: {errors}"
    assert not problems, "\n".join(problems)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "aborts_requests: the test stops requests on purpose (the Stop button)")
    config.addinivalue_line("markers", "console_errors_expected: the test provokes failed loads on purpose (4xx)")
