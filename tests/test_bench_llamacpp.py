"""`minivllm bench llamacpp`: parsing llama-batched-bench's output and finding the binary. The llama.cpp build
is not needed here: the parser runs on an output captured from a real run (tests/fixtures/)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from minivllm.bench.llamacpp import (
    BatchedBenchResult,
    BatchedBenchRow,
    LevelComparison,
    LlamaCppNotFoundError,
    _warn_if_pool_too_small,
    batched_bench_command,
    context_size,
    find_llamacpp_bench,
    fixed_length,
    format_comparison,
    level_comparison,
    parse_batched_bench_output,
    plot_comparison,
)

FIXTURE = Path(__file__).parent / "fixtures" / "llama_batched_bench_output.txt"


def test_parses_the_captured_table():
    rows, settings = parse_batched_bench_output(FIXTURE.read_text())
    assert [r.b for r in rows] == [1, 2]
    first = rows[0]
    assert isinstance(first, BatchedBenchRow)
    assert (first.pp, first.tg, first.b) == (32, 16, 1)
    assert first.n_kv == first.b * (first.pp + first.tg)  # no -pps: every sequence has its own prompt
    for r in rows:
        assert r.s_tg == pytest.approx(r.b * r.tg / r.t_tg, rel=0.02)
        assert r.s_pp == pytest.approx(r.b * r.pp / r.t_pp, rel=0.02)
        assert r.t == pytest.approx(r.t_pp + r.t_tg, abs=0.002)
    assert settings["n_batch"] == "2048" and settings["n_ubatch"] == "512"
    assert settings["is_pp_shared"] == "0"
    assert "n_threads" in settings


def test_ignores_log_lines_and_rejects_unknown_columns():
    text = (
        "llama_model_loader: - kv   0: general.architecture str = llama\n"
        "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
        "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
        "|    40 |     64 |    8 |    832 |    0.500 |   640.00 |    2.000 |   256.00 |    2.500 |   332.80 |\n"
        "| model | size |\n"
    )
    rows, settings = parse_batched_bench_output(text)
    assert rows == [BatchedBenchRow(40, 64, 8, 832, 0.5, 640.0, 2.0, 256.0, 2.5, 332.8)]
    assert settings == {}
    with pytest.raises(ValueError, match="unexpected llama-batched-bench columns"):
        parse_batched_bench_output("|    PP |     TG |    B |   N_KV |\n")


def test_command_gives_every_sequence_its_own_prompt_and_room_for_it():
    cmd = batched_bench_command("/x/llama-batched-bench", "/m.gguf", 40, 128, [1, 8, 32], threads=2)
    assert "-pps" not in cmd
    assert cmd[cmd.index("-npl") + 1] == "1,8,32"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-tb") + 1] == "2"
    assert int(cmd[cmd.index("-c") + 1]) == context_size(40, 128, [1, 8, 32]) >= 32 * (40 + 128)


def test_missing_binary_says_how_to_build_it(tmp_path):
    with pytest.raises(LlamaCppNotFoundError) as excinfo:
        find_llamacpp_bench({"MINIVLLM_LLAMACPP_DIR": str(tmp_path)})
    message = str(excinfo.value)
    assert "llama-batched-bench" in message
    assert "make bench-llamacpp" in message and "scripts/build_llamacpp.sh" in message
    assert str(tmp_path) in message
    assert isinstance(excinfo.value, FileNotFoundError)  # the CLI prints it as `error: ...`, exit status 2


def test_finds_the_build_script_layout(tmp_path):
    binary = tmp_path / "build-0.3.36" / "bin" / "llama-batched-bench"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    assert find_llamacpp_bench({"MINIVLLM_LLAMACPP_DIR": str(tmp_path)}) == binary
    assert os.access(binary, os.X_OK)


def test_cli_reports_a_missing_build_before_loading_the_model(tmp_path, monkeypatch, capsys):
    from minivllm import cli, engine_args

    monkeypatch.setenv("MINIVLLM_LLAMACPP_DIR", str(tmp_path))
    monkeypatch.setattr(engine_args, "build_engine", lambda args: pytest.fail("the model must not be loaded"))
    assert cli.main(["bench", "llamacpp", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "make bench-llamacpp" in err


def test_comparison_table_has_both_sides_and_ratios():
    c = LevelComparison(
        8,
        40,
        64,
        ours_decode_tok_s=100.0,
        ours_prompt_tok_s=None,
        llamacpp_decode_tok_s=400.0,
        llamacpp_prompt_tok_s=1000.0,
        llamacpp_command="llama-batched-bench ...",
        ours_rss_bytes=700 * 2**20,
        llamacpp_peak_rss_bytes=150 * 2**20,
    )
    header, _, line = format_comparison([c])
    assert "mini-vllm decode tok/s" in header and "llama.cpp decode tok/s" in header and "RSS MiB" in header
    assert "0.25x" in line and "400.0" in line and "100.0" in line and "-" in line
    assert line.endswith("700 / 150")


def _their_run(level: int, decode: float, prompt: float, peak: int) -> BatchedBenchResult:
    row = BatchedBenchRow(40, 64, level, level * 104, 1.0, prompt, 1.0, decode, 2.0, 1.0)
    return BatchedBenchResult(["llama-batched-bench", "-npl", str(level)], [row], peak_rss_bytes=peak)


def test_rounds_become_medians_and_per_round_ratios():
    ours = [(SimpleNamespace(decode_tokens_per_s=d), p) for d, p in ((150.0, 300.0), (180.0, None), (120.0, 330.0))]
    theirs = [_their_run(8, d, p, peak) for d, p, peak in ((100.0, 200.0, 1), (120.0, 300.0, 2), (130.0, 220.0, 3))]
    c = level_comparison(8, 40, 64, ours, theirs)
    assert (c.ours_decode_tok_s, c.llamacpp_decode_tok_s) == (150.0, 120.0)
    assert (c.ours_prompt_tok_s, c.llamacpp_prompt_tok_s) == (315.0, 220.0)  # a round without a prompt rate is left out
    assert c.decode_ratios == pytest.approx((1.5, 1.5, 120 / 130))
    assert c.prompt_ratios == pytest.approx((1.5, 1.5))  # paired by round: the second round had no prompt rate of ours
    assert c.llamacpp_peak_rss_bytes == 3 and c.ours_rss_bytes > 0
    header, _, line = format_comparison([c])
    assert header.count("per round") == 2
    assert "0.92-1.50x" in line and "1.50-1.50x" in line and "1.25x" in line  # decode median ratio 150 / 120


def test_one_round_keeps_the_table_without_spread_columns():
    c = level_comparison(
        1, 40, 64, [(SimpleNamespace(decode_tokens_per_s=90.0), 200.0)], [_their_run(1, 60.0, 100.0, 5)]
    )
    header, _, line = format_comparison([c])
    assert "per round" not in header and "1.50x" in line and "2.00x" in line


def test_plot_writes_a_png_with_the_ratios(tmp_path):
    c = level_comparison(
        1, 40, 64, [(SimpleNamespace(decode_tokens_per_s=90.0), 200.0)], [_their_run(1, 60.0, 100.0, 5)]
    )
    path = plot_comparison([c], tmp_path / "llamacpp.png", "a title " * 30)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.parametrize("rounds", ["0", "-2", "three"])
def test_rounds_below_one_is_a_usage_error_before_loading(rounds, monkeypatch, capsys):
    from minivllm import cli, engine_args

    monkeypatch.setattr(engine_args, "build_engine", lambda args: pytest.fail("the model must not be loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "llamacpp", "--rounds", rounds])
    assert exit_info.value.code == 2
    assert "--rounds" in capsys.readouterr().err


def test_fixed_length_prompts_repeat_or_cut_each_prompt():
    assert fixed_length([[1, 2, 3], [4, 5, 6, 7, 8, 9]], 5) == [[1, 2, 3, 1, 2], [4, 5, 6, 7, 8]]
    assert [len(p) for p in fixed_length([[7], list(range(40))], 2000)] == [2000, 2000]


def test_a_level_the_pool_cannot_hold_is_warned_about(capsys):
    engine = SimpleNamespace(kv_cache=SimpleNamespace(num_blocks=100, block_size=16))  # 1,600 slots
    _warn_if_pool_too_small(engine, [1, 4], 401)  # 4 x 400 would just fit
    out = capsys.readouterr().out
    assert "4 concurrent x 401 tokens" in out and "1600 slots" in out and "1 concurrent" not in out
