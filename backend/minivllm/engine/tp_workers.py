"""Tensor-parallel ranks (`--tensor-parallel-size N`): starting them, and sending each step to them.

Rank 0 hosts the engine: it schedules, samples and answers; ranks 1..N-1 are workers that hold their slice
of the model (model/tensor_parallel.py) and a KV pool of their KV heads, and run the same `ModelRunner`
calls in the same order, so the collectives inside the model meet. On one machine the engine spawns them
(torch.multiprocessing, `tcp://127.0.0.1`); under `torchrun` (RANK / WORLD_SIZE set) every process joins
the c10d rendezvous instead, and a rank above 0 serves steps until rank 0 closes, then exits.

Spawned ranks map a shared-memory segment rank 0 creates (model/tensor_parallel.py) for their collectives,
so each keeps the native decode step; torchrun's ranks, possibly on other machines, use the group's.

Rank 0's runner broadcasts what it is about to run (the step's `SeqWork`s without their callbacks, block
copies, window shifts, an early exit's layer count) on a gloo group of its own, then runs it: one pickled
message a step. gloo carries CPU tensors; NCCL carries CUDA ones (the step messages stay on gloo).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.console import progress
from minivllm.core.step_work import PromptLogprobsRows, SeqWork
from minivllm.engine.config import EngineConfig
from minivllm.engine.model_runner import ModelRunner
from minivllm.env import env_flag
from minivllm.errors import ConfigError
from minivllm.kernels.cpu import native
from minivllm.loader import LoadedModel, load_model
from minivllm.model import tensor_parallel
from minivllm.model.attention import KVCache
from minivllm.model.compiled import use_compilation
from minivllm.model.tensor_parallel import TPGroup

INIT_TIMEOUT = timedelta(minutes=10)  # the rendezvous, and any one collective inside a step
IDLE_TIMEOUT = timedelta(days=365)  # a worker waits for the next step as long as the server idles
JOIN_SECONDS = 30
SHARED_MEMORY_ENV = "MINIVLLM_TP_SHARED_MEMORY"  # 0: spawned ranks sum over gloo as across machines (A/B benches)


def prepare(config: EngineConfig, speculative, threads: int | None, load_args: dict) -> TPGroup | None:
    """This process's rank before the model loads (None without tensor parallelism). Under torchrun the
    rendezvous happens here, and a rank above 0 never returns: it serves steps, then exits. Spawned
    workers start later (`connect`), once rank 0's own load has checked that the split divides."""
    size = config.tensor_parallel_size
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}", "tensor_parallel_size")
    if size == 1:
        return None
    _check_supported(config, speculative)
    torch.set_num_threads(threads or 1)  # --threads is per rank: 1 by default under tensor parallelism
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun's
        tp = _join_torchrun(size, load_args)
    else:
        tp = TPGroup(0, size)
    tensor_parallel.set_current(tp)
    return tp


def torchrun_worker() -> bool:
    """Whether torchrun started this process as a rank above 0."""
    return "WORLD_SIZE" in os.environ and int(os.environ.get("RANK", "0")) > 0


def _check_supported(config: EngineConfig, speculative) -> None:
    if speculative is not None and speculative.method == "draft_model":
        raise ConfigError(
            "tensor parallelism runs n-gram and early-exit speculation; a draft model is not split across ranks",
            "tensor_parallel_size",
        )
    if config.kv_offload_dir is not None:
        raise ConfigError("--kv-offload-dir keeps one rank's KV blocks: not with tensor parallelism", "kv_offload_dir")


def _join_torchrun(size: int, load_args: dict) -> TPGroup:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ConfigError(
            f"--tensor-parallel-size {size} but torchrun started WORLD_SIZE={world} processes", "tensor_parallel_size"
        )
    backend = _backend(load_args.get("device"))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    tp = _init(rank, world, "env://", backend)
    if rank > 0:
        try:
            _serve(tp, load_args, eager=True)  # across machines: no shared segment, so no native step either
        finally:
            dist.destroy_process_group()
        raise SystemExit(0)
    return tp


def connect(tp: TPGroup | None, loaded: LoadedModel, load_args: dict, threads: int | None, eager: bool) -> None:
    """Rank 0, its slice loaded: spawn the workers (unless torchrun started them) and meet them. Spawned
    ranks share a memory segment for their collectives; `eager`: the workers' --enforce-eager."""
    if tp is None:
        return
    if tp.group is None:
        init = f"tcp://127.0.0.1:{_free_port()}"
        backend = _backend(str(loaded.device))
        segment = tensor_parallel.create_segment(tp.world) if _shares_memory(backend) else None
        ctx = mp.get_context("spawn")
        worker_args = (tp.world, init, backend, segment, load_args, threads or 1, eager)
        tp.processes = [ctx.Process(target=_spawned, args=(r, *worker_args), daemon=True) for r in range(1, tp.world)]
        for process in tp.processes:
            process.start()
        try:
            tp.shm = tensor_parallel.map_segment(segment, tp.rank, tp.world)
            joined = _init(0, tp.world, init, backend)  # every rank has mapped the segment: its name can go
        finally:
            if segment is not None:
                os.unlink(segment)
        tp.group, tp.steps = joined.group, joined.steps
    loaded.model.runner_class = TPModelRunner  # the engine's runner (ModelRunner.for_model)
    atexit.register(stop, tp)  # a script that never calls close() still lets its workers exit cleanly
    tensor_parallel.restrict_steps(loaded.model)
    tensor_parallel.set_current(None)  # loaded: the group lives on as model.tp; a later load is whole
    over = "shared memory" if tp.shm is not None else dist.get_backend(tp.group)
    progress(f"tensor parallelism: {tp.world} ranks over {over}, {threads or 1} thread(s) each")


def _shares_memory(backend: str) -> bool:
    """Whether spawned ranks can sum through a shared segment: CPU tensors, our kernels built."""
    return backend == "gloo" and native.available() is None and env_flag(SHARED_MEMORY_ENV, default=True)


def _backend(device: str | None) -> str:
    cuda = device.startswith("cuda") if device not in (None, "auto") else torch.cuda.is_available()
    return "nccl" if cuda else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, init_method: str, backend: str) -> TPGroup:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=INIT_TIMEOUT)
    steps = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, world, group=dist.group.WORLD, steps=steps)


def _spawned(
    rank: int,
    world: int,
    init_method: str,
    backend: str,
    segment: str | None,
    load_args: dict,
    threads: int,
    eager: bool,
) -> None:
    """A spawned worker's whole life."""
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        load_args = {**load_args, "device": f"cuda:{rank}"}
    shm = tensor_parallel.map_segment(segment, rank, world)  # before the rendezvous, after which rank 0 unlinks it
    tp = dataclasses.replace(_init(rank, world, init_method, backend), shm=shm)
    try:
        _serve(tp, load_args, eager)
    finally:
        dist.destroy_process_group()


def _serve(tp: TPGroup, load_args: dict, eager: bool) -> None:
    """A worker: load its slice, then mirror rank 0's runner calls until told to stop."""
    tensor_parallel.set_current(tp)
    loaded = load_model(**load_args)
    use_compilation(loaded.model, loaded.device, eager)
    tensor_parallel.restrict_steps(loaded.model)
    runner = None
    while True:
        message = _receive(tp)
        if message[0] == "build":
            runner = ModelRunner(loaded.model, KVCache(*message[1], device=loaded.device))
        elif message[0] == "step":
            single, chunks, copies, hidden, num_layers, shifts = message[1:]
            runner.execute(single, chunks, copies, [] if hidden else None, num_layers, shifts)
        else:
            dist.barrier(group=tp.steps)  # rank 0 tears the group down only once every rank has heard
            return


def _send(tp: TPGroup, message: tuple) -> None:
    dist.broadcast_object_list([message], src=0, group=tp.steps)


def _receive(tp: TPGroup) -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.steps)
    return box[0]


class TPModelRunner(ModelRunner):
    def __init__(self, model, kv_cache: KVCache):
        self.tp: TPGroup = model.tp
        pool = (len(kv_cache.k), kv_cache.num_blocks, kv_cache.block_size, model.config.num_key_value_heads)
        _send(self.tp, ("build", (*pool, model.config.head_dim, kv_cache.k[0].dtype)))
        super().__init__(model, kv_cache)

    def execute(self, single, chunks, copies=None, hidden_states_out=None, num_layers=None, shifts=None):
        work = ([_portable(w) for w in single], [_portable(w) for w in chunks])
        _send(self.tp, ("step", *work, copies, hidden_states_out is not None, num_layers, shifts))
        return super().execute(single, chunks, copies, hidden_states_out, num_layers, shifts)

    def close(self) -> None:
        stop(self.tp)


def _portable(work: SeqWork) -> SeqWork:
    """A step's work without its callbacks (rank 0's alone); prompt log-probs keep their rows, so a worker
    makes the same LM-head calls."""
    rows = work.prompt_logprobs
    if rows is not None:
        rows = PromptLogprobsRows(rows.first_row, rows.targets, rows.top_n, _discard)
    return dataclasses.replace(work, prompt_logprobs=rows, pooled=None)


def _discard(*_args) -> None:
    return None


def stop(tp: TPGroup | None) -> None:
    """Rank 0: workers told to stop and joined (terminated past JOIN_SECONDS), the process group gone.
    Idempotent: close() may come twice."""
    if tp is None or tp.rank != 0 or tp.stopped:
        return
    tp.stopped = True
    if tp.steps is not None:
        try:
            _send(tp, ("stop",))
            dist.barrier(group=tp.steps)
        except RuntimeError as exc:  # a worker already gone: the rest are terminated below
            progress(f"tensor parallelism: a worker did not answer the stop ({exc}); terminating")
    for process in [p for p in tp.processes or [] if p.pid is not None]:  # started ones
        process.join(JOIN_SECONDS if tp.steps is not None else 0)
        if process.is_alive():
            process.terminate()
            process.join()
    if dist.is_initialized():
        dist.destroy_process_group()
    tensor_parallel.set_current(None)
