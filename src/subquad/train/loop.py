"""``subquad train``: the papers' models trained on a task (``train.tasks``), with checkpoints and exact resume.

AdamW with linear warm-up and cosine decay, gradient clipping and accumulation; auxiliary losses
(routing's commitment) collected through ``subquad.hooks`` and added; bf16 autocast as an option;
evaluation in bits per byte every ``eval_every`` steps. The run folder holds ``config.json``,
``metrics.jsonl`` (a line per step and per evaluation, flushed as written), ``checkpoints/`` and, at
the end, ``summary.json`` and ``curve.png``. Batches are a function of (seed, step), and a checkpoint holds every
RNG, so ``resume=True`` after a kill at any moment ends with the weights of the run that was
never killed, bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from subquad import hooks
from subquad.files import FileError, read_jsonl, write_atomic
from subquad.flags import named
from subquad.train import checkpoint
from subquad.train.config import (  # noqa: F401 (TrainConfig and its readers, as they were imported from here)
    TrainConfig,
    check_run,
    check_trained_with,
    jsonable,
    load_config_file,
    train_config,
    write_config,
)  # fmt: skip
from subquad.train.tasks import make_task

__all__ = ["Progress", "plot_curve", "read_metrics", "resolve_device", "train", "trimmed_log"]


def _schedule(config: TrainConfig):
    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        floor = config.min_lr / config.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _evaluate(model: nn.Module, task: Any) -> float:
    model.eval()
    with torch.no_grad():
        value = task.evaluate(model)
    model.train()
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (``train`` or ``distill``): each a step and numbers.
    A last line cut off by a kill is dropped; any other broken line is a FileError naming it."""
    fix = "a run's own log holds a JSON object of a step and numbers per line; remove the lines that are not"
    records = read_jsonl(path, "metrics log", fix, partial_last=True)
    for number, record in records:
        if not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
            raise FileError(path, f"line {number} has no integer step", fix)
        wrong = [k for k, v in record.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if wrong:
            verb = "is" if len(wrong) == 1 else "are"
            raise FileError(path, f"line {number}: {', '.join(wrong)} {verb} not a number", fix)
    return [record for _, record in records]


def trimmed_log(path: Path, step: int) -> list[dict[str, Any]]:
    """The records of a resumed run's log up to ``step``, the file rewritten to hold only those: what a
    run logged after its last checkpoint is done again (``read_metrics``)."""
    if not path.exists():
        return []
    kept = [record for record in read_metrics(path) if record["step"] <= step]
    write_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))
    return kept


class _Log:
    """``metrics.jsonl``: on resume, lines past the checkpoint's step are dropped (they are redone)."""

    def __init__(self, path: Path, step: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.kept = trimmed_log(path, step)  # what the run logged before its checkpoint
        self.file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def train(config: TrainConfig, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train (or resume) the run of ``config``; returns the summary it writes.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) it joins the process group (gloo on CPU, NCCL on GPU),
    each process computes its slice of every global batch under DDP, and only rank 0 writes.
    """
    checkpoint.require()  # before any work: a run that cannot save must not start
    device = _device(config.device)
    rank, world = _distributed(device)
    if config.batch % (world * config.accumulate):
        raise ValueError(
            f"{named(config, 'batch')} {config.batch} must split into {world} processes × accumulate="
            f"{config.accumulate} equal parts"
        )
    task = make_task(config)  # bad data fails before the run exists
    task.device = device
    out = Path(config.out)
    if rank == 0:
        check_run(config, resume)
    _barrier(world)
    last = checkpoint.latest(out / "checkpoints") if resume else None  # every rank, after rank 0 checked
    if last is not None:  # a damaged or foreign checkpoint is refused before the model is built
        check_trained_with(config, checkpoint.verify(last), last / "state.json", resume=True)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model = task.model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    step = _restore(last, model, optimizer, scheduler) if last is not None else 0
    log = _Log(out / "metrics.jsonl", step) if rank == 0 else None  # a broken log refused before any write
    if rank == 0:
        write_config(config)
    sign = 1 if task.lower_is_better else -1
    before = [r[task.metric] * sign for r in (log.kept if log else []) if task.metric in r]
    best, started = min(before, default=math.inf) * sign, time.perf_counter()
    runner = _Losses(model, task, world, device)
    with Progress(config, step, progress and rank == 0) as bar:
        while step < config.steps:
            loss, seconds = _step(runner, optimizer, scheduler, task, config, step, rank, world)
            step += 1
            record = [{"step": step, **task.train_metric(loss), "lr": scheduler.get_last_lr()[0],
                       "tokens_per_s": config.batch * config.seq_len / seconds}]  # fmt: skip
            if step % config.eval_every == 0 or step == config.steps:
                val = _evaluate(model, task)  # every rank: the same numbers
                best = min(best * sign, val * sign) * sign
                record.append({"step": step, task.metric: val})
            if rank == 0:
                _keep(config, step, record, log, model, optimizer, scheduler)
            bar.update(step, record[0], best)
    summary = {"steps": step, "seconds": time.perf_counter() - started, f"best_{task.metric}": best, "processes": world}
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_curve(
            out / "metrics.jsonl", out / "curve.png", title=f"{config.task}: {config.attention}, N = {config.seq_len}"
        )
    _barrier(world)
    return summary


def _restore(last: Path, model: nn.Module, optimizer: Any, scheduler: Any) -> int:
    """Load the checkpoint ``last`` into the model, optimizer, scheduler and every RNG; its step."""
    with checkpoint.fitting(last):  # nothing is written before the checkpoint has loaded
        state = checkpoint.load(last, model)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        return state["step"]


def _keep(config: TrainConfig, step: int, records: list[dict], log: _Log, model: nn.Module, optimizer: Any,
          scheduler: Any) -> None:  # fmt: skip
    """Rank 0 after a step: the step's records to the log, and a checkpoint when one is due."""
    for r in records:
        log.write(r)
    if step % config.checkpoint_every == 0 or step == config.steps:
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        state["rng"] = checkpoint.rng_state()
        meta = {"config": jsonable(config)}  # what evaluate checks config.json against
        checkpoint.save(Path(config.out) / "checkpoints", step, model, state, config.keep, meta)


def _distributed(device: torch.device) -> tuple[int, int]:
    """This process's rank and the world size; joins the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world


def _device(name: str) -> torch.device:
    """The device of ``--device``, made current; under torchrun on GPUs each process takes ``cuda:LOCAL_RANK``."""
    device = resolve_device(name, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device ``name`` stands for: ``auto`` is cuda where this torch sees a CUDA device, else
    cpu; a bare ``cuda`` is ``cuda:local_rank`` (torchrun's ``LOCAL_RANK``). Raises ValueError,
    naming the value and the fix, for a device that is not cpu or cuda, or a CUDA device this
    machine lacks (which CUDA would report as an invalid ordinal)."""
    given = name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from error
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch sees no CUDA device; pass --device cpu")
    count = torch.cuda.device_count()
    if device.index is None:
        if local_rank >= count:
            raise ValueError(
                f"--device {given}: the process of LOCAL_RANK {local_rank} takes cuda:{local_rank}, but this machine "
                f"has {count} CUDA device(s); start at most {count} process(es) per node (torchrun "
                f"--nproc_per_node {count}), or pass --device cpu"
            )
        device = torch.device("cuda", local_rank)
    elif device.index >= count:
        raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


class _LossForward(nn.Module):
    """The task's loss as a forward, so DistributedDataParallel can synchronise its gradients."""

    def __init__(self, model: nn.Module, task: Any) -> None:
        super().__init__()
        self.model, self.task = model, task

    def forward(self, batch: Any) -> Tensor:
        return self.task.loss(self.model, batch)


class _Losses:
    """Runs the loss of a batch, under DistributedDataParallel when there are several processes."""

    def __init__(self, model: nn.Module, task: Any, world: int, device: torch.device) -> None:
        self.model, self.forward, self.device = model, _LossForward(model, task), device
        self.parallel = DistributedDataParallel(self.forward) if world > 1 else None

    def run(self, batch: Any, sync: bool) -> Tensor:
        """The loss of ``batch``; ``sync``: this backward all-reduces the gradients."""
        if self.parallel is None:
            return self.forward(batch)
        if sync:
            return self.parallel(batch)
        with self.parallel.no_sync():
            return self.parallel(batch)


class Progress:
    """Progress on stderr: a rich bar (loss, best evaluation, tokens/s, ETA) on a terminal, else
    about a hundred plain lines per run, which logs keep readably."""

    def __init__(self, config: TrainConfig, first: int, enabled: bool) -> None:
        self.config, self.first, self.started = config, first, time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            except ImportError:  # the train extra installs rich; plain lines without it
                pass
            else:
                columns = (BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[text]}"), TimeRemainingColumn())
                self.bar = Progress(*columns)
                self.task = self.bar.add_task("train", total=config.steps, completed=first, text="")
                self.bar.start()
        self.enabled = enabled

    def update(self, step: int, record: dict, best: float) -> None:
        if not self.enabled:
            return
        c = self.config
        elapsed = time.perf_counter() - self.started
        rate = (step - self.first) / elapsed if elapsed > 0 else 0.0
        train = "  ".join(f"{k} {v:.3f}" for k, v in record.items() if k.startswith("loss"))
        val = f"  best val {best:.3f}" if math.isfinite(best) else ""
        text = f"{train}{val}  {rate * c.batch * c.seq_len:,.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, text=text)
        elif step % max(1, c.steps // 100) == 0 or step == c.steps:
            eta = (c.steps - step) / rate if rate else 0.0
            print(f"step {step}/{c.steps}  {text}  ETA {eta:,.0f} s", file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def plot_curve(metrics: Path, png: Path, title: str = "") -> Path | None:
    """Training and validation bits per byte against the step, from ``metrics.jsonl``; None without
    matplotlib (``pip install 'subquad[train]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(metrics)
    train_key = next((k for r in records for k in r if k.startswith("loss")), "loss")
    val_key = next((k for r in records for k in r if k.startswith("val_")), "val")
    train_points = [(r["step"], r[train_key]) for r in records if train_key in r]
    val_points = [(r["step"], r[val_key]) for r in records if val_key in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train_points:
        ax.plot(*zip(*train_points), lw=0.8, alpha=0.7, label="train")
    if val_points:
        ax.plot(*zip(*val_points), "o-", label="validation")
    ax.set(xlabel="step", ylabel=f"{train_key} / {val_key}", title=title)
    if train_points or val_points:
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _step(
    runner: _Losses, optimizer, scheduler, task: Any, config: TrainConfig, step: int, rank: int, world: int
) -> tuple[float, float]:
    """One optimizer step on this rank's slice of the global batch of ``step``; returns the mean
    loss of the whole batch (nats) and the seconds it took."""
    t = time.perf_counter()
    micros = task.split(task.batch(step, rank, world), config.accumulate)
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=runner.device)
    for i, micro in enumerate(micros):
        autocast = torch.autocast(runner.device.type, torch.bfloat16, enabled=config.bf16)
        with hooks.auxiliary_losses() as aux, autocast:
            loss = runner.run(micro, sync=i == len(micros) - 1)  # gradients meet once, on the last
            objective = loss + sum(aux) if aux else loss
        (objective / config.accumulate).backward()
        total += loss.detach().float() / config.accumulate
    if world > 1:
        dist.all_reduce(total)
        total /= world
    if not math.isfinite(float(total)):  # every rank: the same reduced loss
        raise ValueError(
            f"the training loss is {float(total)} at step {step + 1}: the run diverged (lr={config.lr}, clip="
            f"{config.clip}); its checkpoints before this step are kept: start it again with a lower --lr or --clip"
        )
    if config.clip:
        nn.utils.clip_grad_norm_(runner.model.parameters(), config.clip)
    optimizer.step()
    scheduler.step()
    return float(total), time.perf_counter() - t
