"""``recomp bench --tp N``: the built-in decoder with tensor + sequence parallelism.

The decoder runs on N gloo processes on the CPU, parallelised with DTensor as
torchtitan does it: ``SequenceParallel`` norms, a ``PrepareModuleInput`` that
all-gathers the sequence before attention and before the MLP, column-parallel
q/k/v/gate/up and row-parallel o/down projections whose outputs are
reduce-scattered back to sequence shards. Every collective runs inside the layers,
issued by DTensor.

Per strategy each rank trains from the same weights and data; rank 0 reports its
activation memory (allocator, one malloc arena), the bytes recomp's checkpoints keep
for the results of collectives (``recomp.torch.collectives.kept_collective_bytes``,
read after the forward), the collectives the replay runs (and the bytes they move),
and the largest gradient difference to the parallelised model without checkpoints.
Strategies (recomp's checkpoints, per layer):

=============================================  ========================================
``none``                                       no checkpointing
``full``                                       every layer checkpointed; collectives'
                                               results kept
``exclude:attn``                               the same, attention excluded (it runs
                                               once)
``full+replay-collectives``                    ``full`` with ``exclude_collectives=False``:
                                               nothing kept for collectives, the replay
                                               communicates again
``full+replay-collectives+exclude:attn``       ``exclude:attn`` with
                                               ``exclude_collectives=False``
=============================================  ========================================

(``full:no-keep`` and ``exclude-attn:no-keep``, the names of earlier versions, are
read as the last two.)

The parent (``run``) starts the ranks as ``python -m recomp.cli.torch.tensor_parallel``,
bounded in time; every rank it started, and every file of the run, is gone when it
returns or raises.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..config import DEFAULT_MODEL, BenchConfig
from ..jobs import child_environment
from ..memory import malloc_in_use
from ..strategies import parse

TP_STRATEGIES = (
    "none",
    "full",
    "full+replay-collectives",
    "exclude:attn",
    "full+replay-collectives+exclude:attn",
)
#: The strategies whose replay runs the collectives again (``exclude_collectives=False``).
REPLAYING = "full+replay-collectives"
# Measured forwards per strategy. The first measured forward reads about 64 KiB less than
# the others (something the warm-up left is freed during it), and any reading can read
# more by what the process group's threads hold at that moment (they allocate from the
# same arena: 130 to 200 KiB in one reading of five on a quiet machine here, in most of
# them once under load). What counts is the lowest reading after the first: the forward's
# own allocations, which the others agree with to 1 %.
READINGS = 6


def check_config(config: BenchConfig, tp: int, strategies: list[str]) -> None:
    """Refuse what ``--tp`` cannot run, saying what to change."""
    if tp < 2:
        raise ValueError(f"--tp takes the number of processes, at least 2; got {tp}")
    if config.model != DEFAULT_MODEL:
        raise ValueError(
            "--tp runs the built-in decoder only (it knows its tensor-parallel plan): "
            "drop --model"
        )
    if config.device != "cpu" or config.compile:
        raise ValueError("--tp runs eagerly on the CPU (gloo): drop --device and --compile")
    for name, value in (("heads", config.heads), ("seq", config.seq)):
        if value % tp:
            raise ValueError(f"--tp {tp} must divide --{name} ({value})")
    unknown = [s for s in strategies if s not in TP_STRATEGIES]
    if unknown:
        raise ValueError(
            f"--tp runs {', '.join(TP_STRATEGIES)}; not {', '.join(unknown)}"
        )


# --------------------------------------------------------------------------- one rank


def parallelize(model: Any, mesh: Any) -> Any:
    """Apply the tensor + sequence parallel plan to the built-in ``Decoder`` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    layer_plan = {
        "attn_norm": SequenceParallel(),
        "attn": gather,
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "mlp_norm": SequenceParallel(),
        "mlp": gather,
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for layer in model.layers:
        parallelize_module(layer, mesh, layer_plan)
    parallelize_module(
        model,
        mesh,
        {
            # The replicated input becomes sequence shards (a local split).
            "layers.0": PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_output=False,
            ),
            "norm": SequenceParallel(),
        },
    )
    return model


def _build(config: BenchConfig, strategy: str, mesh: Any) -> tuple[Any, Any]:
    import torch

    from recomp.torch import apply_activation_checkpointing

    from .models import Attention, DecoderLayer, llama

    torch.manual_seed(config.seed)
    model = parallelize(llama(config.layers, config.hidden, config.heads), mesh)
    generator = torch.Generator().manual_seed(config.seed + 1)
    x = torch.randn(config.batch, config.seq, config.hidden, generator=generator)
    parsed = parse(strategy)
    if parsed.kind != "none":
        apply_activation_checkpointing(
            model,
            checkpoint_fn=DecoderLayer,
            exclude_fn=Attention if parsed.regions == ("attn",) else None,
            exclude_collectives=not parsed.kind.startswith(REPLAYING),
        )
    return model, x


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def measure_rank(config: BenchConfig, strategies: list[str], mesh: Any) -> list[dict[str, Any]]:
    """Each strategy's figures on this rank (inside an initialised process group)."""
    import torch

    from recomp.torch.collectives import count_collectives, kept_collective_bytes

    def loss_of(model: Any, x: Any) -> Any:
        # The output as a whole (one all-gather, after the layers): the loss and its
        # gradient are those of the model in one process.
        return model(x).full_tensor().square().mean()

    reference, x = _build(config, "none", mesh)
    loss_of(reference, x).backward()
    expected = [_local(p.grad).detach().clone() for p in reference.parameters()]
    del reference
    rows = []
    for strategy in strategies:
        model, x = _build(config, strategy, mesh)
        params = list(model.parameters())
        loss = loss_of(model, x)
        first_loss = float(loss.detach())
        loss.backward()
        grad_diff = max(
            float((_local(p.grad) - ref).abs().max()) for p, ref in zip(params, expected, strict=True)
        )
        # No update: every step is the same one.
        for _ in range(config.warmup):
            model.zero_grad(set_to_none=False)
            loss_of(model, x).backward()
        readings = []
        for _ in range(READINGS):
            model.zero_grad(set_to_none=False)
            gc.collect()
            torch.distributed.barrier()
            with count_collectives() as counts:
                before = malloc_in_use()
                loss = loss_of(model, x)
                readings.append(malloc_in_use() - before)
                kept = kept_collective_bytes()
                loss.backward()
            del loss
        itemsize = torch.finfo(torch.float32).bits // 8
        replayed = [e for e in counts.events if e.phase == "replay"]
        rows.append(
            {
                "strategy": strategy,
                "keeps_collectives": strategy != "none" and not strategy.startswith(REPLAYING),
                "activation_bytes": min(readings[1:]),
                "kept_collective_bytes": kept,
                "forward_collectives": counts.total("forward"),
                "replay_collectives": dict(sorted(counts.replay.items())),
                "replay_comm_bytes": sum(e.numel for e in replayed) * itemsize,
                "max_grad_diff": grad_diff,
                "loss": first_loss,
            }
        )
        del model, params
    return rows


def rank_main(config_path: str, out_dir: str) -> int:
    """One rank: ``python -m recomp.cli.torch.tensor_parallel CONFIG.json OUT_DIR`` with RANK,
    WORLD_SIZE and RECOMP_BENCH_INIT (a ``file://`` rendezvous) in the environment."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with open(config_path) as f:
        task = json.load(f)
    config = BenchConfig.from_dict(task["config"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, config.threads))
    dist.init_process_group(
        "gloo",
        init_method=os.environ["RECOMP_BENCH_INIT"],
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=task["timeout"]),
    )
    try:
        rows = measure_rank(config, task["strategies"], init_device_mesh("cpu", (world,)))
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rows, f)
        os.replace(path + ".tmp", path)
        dist.barrier()  # both ranks done before either closes its connections
    finally:
        dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- parent


def run(
    config: BenchConfig, strategies: list[str], tp: int, timeout: float = 600.0
) -> list[dict[str, Any]]:
    """Start ``tp`` ranks, wait at most ``timeout`` seconds, return rank 0's rows.

    Raises ``RuntimeError`` with the tail of a failed rank's output; on failure, timeout
    or an exception here (Ctrl-C) every rank still running is killed first, and the
    run's directory (task, logs, rendezvous, the ranks' temporary files) is removed."""
    check_config(config, tp, strategies)
    with tempfile.TemporaryDirectory(prefix="recomp-tp-") as work:
        task_path = os.path.join(work, "task.json")
        with open(task_path, "w") as f:
            json.dump(
                {"config": config.to_dict(), "strategies": strategies, "timeout": int(timeout)}, f
            )
        scratch = os.path.join(work, "tmp")
        os.mkdir(scratch)
        env = child_environment(config.threads, scratch)
        env["RECOMP_BENCH_INIT"] = f"file://{os.path.join(work, 'rendezvous')}"
        env["WORLD_SIZE"] = str(tp)
        logs = [os.path.join(work, f"rank{r}.log") for r in range(tp)]
        codes, failure = _run_ranks(task_path, work, env, logs, timeout)
        if failure is None and any(c != 0 for c in codes):
            failure = f"exit codes {codes}"
        if failure is not None:
            bad = next((r for r, c in enumerate(codes) if c != 0), 0)
            with open(logs[bad], errors="replace") as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"recomp bench --tp {tp}: {failure}; rank {bad} wrote:\n{tail}")
        with open(os.path.join(work, "rank0.json")) as f:
            rows: list[dict[str, Any]] = json.load(f)
    return rows


def _run_ranks(
    task_path: str, work: str, env: dict[str, str], logs: list[str], timeout: float
) -> tuple[list[int | None], str | None]:
    """Run one process per log until all have ended; their exit codes, and what went
    wrong if they were stopped (every rank is gone when this returns or raises)."""
    procs: list[subprocess.Popen[bytes]] = []
    failure = None
    try:
        for rank, log_path in enumerate(logs):
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "recomp.cli.torch.tensor_parallel", task_path, work],
                        env={**env, "RANK": str(rank)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                failure = f"timed out after {timeout:.0f} s"
                break
            # A failed rank leaves the others waiting in a collective: stop them soon.
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > 10.0:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [p.returncode for p in procs], failure


MiB = float(1 << 20)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a text table (rank 0's figures)."""
    header = [
        "strategy",
        "keeps collectives",
        "activation MiB",
        "kept for collectives MiB",
        "replay collectives",
        "replay comm MiB",
        "max grad diff",
    ]
    body = [
        [
            r["strategy"],
            "-" if r["strategy"] == "none" else ("yes" if r["keeps_collectives"] else "no"),
            f"{r['activation_bytes'] / MiB:.2f}",
            f"{r['kept_collective_bytes'] / MiB:.2f}",
            " ".join(f"{k}={v}" for k, v in r["replay_collectives"].items()) or "0",
            f"{r['replay_comm_bytes'] / MiB:.2f}",
            f"{r['max_grad_diff']:.1e}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in (0, 1, 4) else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


if __name__ == "__main__":
    sys.exit(rank_main(*sys.argv[1:]))
