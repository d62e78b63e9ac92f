"""Multi-process data parallelism with ``torchrun`` (DistributedDataParallel).

The CLI decides (:func:`cfbnn_cli.cli.run_pipeline`): with ``distributed.nproc > 1``
it calls :func:`launch`, which writes the config -- already resolved once by Hydra --
to ``<run dir>/distributed/config.yaml`` and starts ``torchrun --standalone
--nproc_per_node=N`` with the worker command the CLI gives; each worker calls
:func:`run_worker` with the pipeline's ``run`` (``RANK``/``WORLD_SIZE`` set; NCCL
when the workers have GPUs, gloo otherwise). Only rank 0 writes outputs, and its
result comes back to the launching process as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .errors import CfbnnError, ConfigError
from .io import atomic_write_json, atomic_write_text
from .safefs import output_folder, writing_under


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_sum(value: float, device) -> float:
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor)


def local_rows(global_index: torch.Tensor) -> torch.Tensor:
    """This rank's share of a global minibatch (rows ``rank, rank + world, ...``): together the
    ranks see exactly the global batch a single process would."""
    return global_index[rank() :: world_size()]


def requested_processes(cfg) -> int:
    """``distributed.nproc`` (1 when the config has no ``distributed`` key), checked."""
    nproc = cfg.get("distributed", {}).get("nproc", 1) if hasattr(cfg, "get") else 1
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"distributed.nproc={nproc!r} must be an integer >= 1")
    return nproc


def first_gpu(device: torch.device):
    """The GPU of rank 0 on ``device`` (``cuda``: 0; ``cuda:N``: N; each later rank the next one),
    or ``None`` where the processes run on the CPU (gloo)."""
    return (device.index or 0) if device.type == "cuda" else None


def launch(cfg, run_dir, nproc: int, worker: Sequence[str], device: torch.device) -> dict:
    """Start ``nproc`` torchrun workers and return rank 0's result.

    ``worker`` is the command that runs one worker (after ``python``), given by the caller
    -- the CLI, which knows the pipeline -- and completed here with ``--config`` and
    ``--run-dir``; runtime never imports a pipeline. The config, resolved once here, is
    written to ``<run dir>/distributed/config.yaml`` for every worker to read.
    """
    first = first_gpu(device)
    if first is not None and first + nproc > torch.cuda.device_count():
        raise ConfigError(
            f"distributed.nproc={nproc} from device={cfg.get('device', 'auto')} needs GPUs {first}..{first + nproc - 1} "
            f"(one per process) but {torch.cuda.device_count()} are visible; lower it, or set device=cpu for gloo "
            "processes on the CPU"
        )
    from omegaconf import OmegaConf

    folder = output_folder(Path(run_dir) / "distributed")
    (folder / "result.json").unlink(missing_ok=True)  # never read an earlier launch's result
    atomic_write_text(folder / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *worker,
        "--config",
        str(folder / "config.yaml"),
        "--run-dir",
        str(run_dir),
    ]
    finished = subprocess.run(command)
    if finished.returncode != 0:
        raise CfbnnError(
            f"the {nproc} distributed workers failed (exit {finished.returncode}); see their output above and {run_dir}"
        )
    try:  # JSON, not pickle: nothing in a run dir is ever executed
        return json.loads((folder / "result.json").read_text())
    except (OSError, ValueError) as error:
        raise CfbnnError(
            f"the distributed workers finished but their result {folder / 'result.json'} is unreadable "
            f"({error}); see {run_dir}"
        ) from None


def run_worker(run: Callable, argv=None) -> int:
    """One torchrun worker: ``run(cfg, run_dir)`` of the pipeline the caller passes in,
    with the process group set up (NCCL on GPUs, gloo on CPU); rank 0 writes the result."""
    parser = argparse.ArgumentParser(description="one torchrun worker of a cfbnn pipeline")
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(args.config)
    from .threads import flush_denormals

    flush_denormals(OmegaConf.select(cfg, "runtime.flush_denormals", default=True))  # before any work, as the CLI
    from .device import resolve_device, set_matmul_precision

    set_matmul_precision(OmegaConf.select(cfg, "runtime.matmul_precision", default="highest"))

    first = first_gpu(resolve_device(OmegaConf.select(cfg, "device", default="auto")))  # this process's boundary
    use_cuda = first is not None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(first + local_rank)
        cfg.device = f"cuda:{first + local_rank}"
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    try:
        import logging

        logging.basicConfig(
            level=logging.INFO if is_main() else logging.WARNING,
            format=f"[rank {rank()}][%(name)s][%(levelname)s] - %(message)s",
        )
        with writing_under(args.run_dir):
            result = run(cfg, Path(args.run_dir))
        if is_main():
            result = dict(result)
            result["device"] = str(result.get("device"))
            with writing_under(args.run_dir):
                atomic_write_json(Path(args.run_dir) / "distributed" / "result.json", result)
        barrier()
    finally:
        dist.destroy_process_group()
    return 0
