"""The ``cfbnn`` command: subcommand dispatch onto Hydra applications.

``cfbnn <subcommand> [hydra arguments]``: the words of the subcommand pick a
top-level config in ``conf/`` and a pipeline module; everything after them goes
to Hydra untouched, so overrides (``trainer.epochs=3``), ``--cfg job``,
``-m``/``--multirun`` and ``hydra/launcher=...`` work as in any Hydra app.

The task function is the only place that knows about Hydra: it validates the config
keys, refuses a finished run's dir unless ``resume=true`` or ``overwrite=true``, locks
the run dir (a second run into it exits 2 naming the owner's pid), binds the dir to the
config's fingerprint (``resume=true`` continues only the same configuration), calls
``pipeline.run(cfg, run_dir)`` (a plain function) and writes ``results.json`` + ``done``
(``status: "failed"`` and no ``done`` when a final metric is not finite). A run that fails
before it writes any output (a bad value, a missing data file) leaves the dir as it found
it, and no dir where Hydra made one for it (:class:`~cfbnn_cli.runtime.rundir.RunDirState`).
A :class:`CfbnnError` becomes one line on stderr and its exit code, Hydra's composition
errors exit 2 (the traceback too with ``HYDRA_FULL_ERROR=1``).
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_starting(signum, frame):  # pragma: no cover - timing; tests/test_trust_interrupts.py
    os.write(2, b"cfbnn: interrupted\n")
    os._exit(130)  # nothing has been written yet: no cleanup to run


if os.path.basename(sys.argv[0] or "") == "cfbnn":
    # the command's own process, still importing: Ctrl-C is one line, not an import's traceback (main()
    # puts Python's handler back, and catches the KeyboardInterrupt it raises from then on)
    signal.signal(signal.SIGINT, _interrupted_while_starting)

import contextlib  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import List, Optional, Sequence, Tuple  # noqa: E402

from .cli_messages import (  # noqa: E402
    WithoutHydraJobError,
    empty_output_dir_override,
    hydra_arguments,
    hydra_message,
    mentions_launcher,
    refuse_empty_output_dir,
    unknown_key_message,
    unread_addition,
    unsafe_path_in,
    unwritable_line,
)
from .runtime.errors import CfbnnError, ConfigError, NonFiniteResultError, one_line  # noqa: E402

log = logging.getLogger("cfbnn")


@dataclass(frozen=True)
class Subcommand:
    words: Tuple[str, ...]
    config_name: str
    pipeline: str
    summary: str

    @property
    def name(self) -> str:
        return " ".join(self.words)


SUBCOMMANDS: Tuple[Subcommand, ...] = (
    Subcommand(
        ("train", "regression"),
        "train_regression",
        "cfbnn_cli.pipelines.regression",
        "train a BNN regressor; gradient variance of analytic vs sampling ELBO (paper Table 1)",
    ),
    Subcommand(
        ("train", "classification"),
        "train_classification",
        "cfbnn_cli.pipelines.classification",
        "fit a closed-form Bayesian classifier to a table (yours: data=csv); held-out accuracy, model.pt",
    ),
    Subcommand(
        ("vae",),
        "vae",
        "cfbnn_cli.pipelines.vae",
        "VAE with a Bayesian decoder, variants v1/v2/v3 (paper Table 2)",
    ),
    Subcommand(
        ("imagenet-predict",),
        "imagenet_predict",
        "cfbnn_cli.pipelines.imagenet",
        "ResNet50 features + Bayesian head: Monte Carlo vs deterministic prediction (paper Figure 1)",
    ),
)

USAGE = """usage: cfbnn <command> [hydra overrides and flags]

commands:
{commands}

Everything after the command goes to Hydra, e.g.
  cfbnn train regression trainer.epochs=5 device=cpu
  cfbnn train regression --cfg job          # print the composed config
  cfbnn train regression -m seed=0,1,2      # a sweep (--multirun)
  cfbnn vae --help                          # the command's config groups

Outputs go to outputs/<command>/<date>/<time>/ (set hydra.run.dir=... to change); each command
ends by printing that directory and its main table.

  cfbnn predict RUN_DIR NEW.csv             # a trained model's predictions for new rows of a table
  eval "$(cfbnn completion bash)"           # tab completion of commands, config groups and keys
  cfbnn report PATH                         # aggregate every results.json under PATH
  cfbnn report PATH --paper                 # ... and paper_reproduction.md (the paper's numbers beside)
  cfbnn train regression -m seed=0,1 hydra/launcher=joblib   # parallel jobs (docs/cli.md: Sweeps)
"""
LAUNCHER_HINT = (
    "cfbnn: see 'Sweeps and launchers' in docs/cli.md for hydra/launcher=joblib|slurm|submitit_local "
    "and the options each needs (e.g. hydra.launcher.partition=... for SLURM)"
)


# not a Hydra application: `cfbnn report` reads finished runs (cfbnn_cli.report.aggregate)
PREDICT_SUMMARY = (
    "predict RUN NEW.csv",
    "a trained model's predictions for new rows: predictions.csv (regression: mean, sd, interval; "
    "classification: label, class probabilities)",
)
REPORT_SUMMARY = (
    "report PATH",
    "tables and figures over every results.json under PATH, mean ± s.e. over seeds "
    "(--paper: beside the paper's numbers)",
)


def usage() -> str:
    entries = [(s.name, s.summary) for s in SUBCOMMANDS] + [PREDICT_SUMMARY, REPORT_SUMMARY]
    width = max(len(name) for name, _ in entries)
    commands = "\n".join(f"  {name.ljust(width)}  {summary}" for name, summary in entries)
    return USAGE.format(commands=commands)


def print_outcome(run_dir: Path, result: dict) -> None:
    """The last lines of a command on stdout: where its outputs are and its main table
    (``result["main_table"]``, else the first Markdown table it wrote)."""
    tables = result.get("tables", {}) or {}
    name = result.get("main_table") or next((t for t in tables if str(t).endswith(".md")), None)
    lines = [f"cfbnn: outputs in {run_dir}"]
    if name and (Path(run_dir) / name).is_file():
        lines += [f"{name}:", (Path(run_dir) / name).read_text(encoding="utf-8").rstrip("\n")]
    print("\n" + "\n".join(lines), flush=True)


def find_subcommand(argv: Sequence[str]) -> Tuple[Optional[Subcommand], List[str]]:
    for sub in SUBCOMMANDS:
        n = len(sub.words)
        if tuple(argv[:n]) == sub.words:
            return sub, list(argv[n:])
    return None, list(argv)


def config_dir() -> Path:
    """The ``conf/`` directory: ``$CFBNN_CONFIG_DIR``; else the copy an installed wheel carries
    (``cfbnn_cli/conf``); else the checkout's ``conf/`` beside the package (an editable install)."""
    override = os.environ.get("CFBNN_CONFIG_DIR")
    here = Path(__file__).resolve().parent
    candidates = ([Path(override)] if override else []) + [here / "conf", here.parent / "conf"]
    for candidate in candidates:
        if (candidate / "shared" / "base.yaml").is_file() and (candidate / "train_regression").is_dir():
            return candidate
    raise CfbnnError(
        f"cannot find the cfbnn config directory (looked in {', '.join(str(c) for c in candidates)}); reinstall cfbnn "
        "(`pip install .` ships conf/ inside the package) or point CFBNN_CONFIG_DIR at a checkout's conf/ folder"
    )


SHARED_CONFIG_ENV = "CFBNN_SHARED_CONFIG"


def _point_hydra_at_shared_configs(conf: Path) -> None:
    """Every command's configs live in ``conf/<command>/``; the shared ``base`` and the launcher
    presets in ``conf/shared/``, which each command's ``hydra.searchpath`` finds through this
    environment variable (a command-line override would break Hydra's argument order)."""
    os.environ[SHARED_CONFIG_ENV] = str(conf / "shared")


def compose_config(config_name: str, overrides: Sequence[str] = (), return_hydra_config: bool = False):
    """A command's composed config, as the CLI composes it (for tests, notebooks and scripts)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    conf = config_dir()
    _point_hydra_at_shared_configs(conf)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf / config_name), version_base="1.3", job_name=config_name):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)


def _report_error(error: CfbnnError) -> None:
    """One line for the user on stderr, and the same line in the run's ``<job>.log`` when
    Hydra set logging up (the console handler writes to stdout, so it is left out)."""
    message = one_line(error)
    print(f"cfbnn: error: {message}", file=sys.stderr, flush=True)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _save_hydra_record(run_dir: Path, cfg) -> None:
    """``.hydra/{config,hydra,overrides}.yaml``, as Hydra would write them, but only once
    this run owns the dir (``hydra.output_subdir`` is null: Hydra itself would
    overwrite the record of a run that is still writing there)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from .runtime.io import atomic_write_text

    hydra_cfg = HydraConfig.get()
    folder = run_dir / ".hydra"
    atomic_write_text(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    atomic_write_text(folder / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})))
    atomic_write_text(folder / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.overrides.task))


def _non_finite(metrics) -> List[str]:
    """Metric names whose value is a NaN or an infinity (``None`` means "not applicable")."""
    bad = []
    for name, value in metrics.items():
        if value is None:
            continue
        try:
            if not math.isfinite(float(value)):
                bad.append(str(name))
        except (TypeError, ValueError):
            bad.append(str(name))
    return bad


WORKER_FLAG = "--distributed-worker"


def run_pipeline(sub: Subcommand, cfg, run_dir, values=None) -> dict:
    """``pipeline.run(cfg, run_dir, values)``, or under ``distributed.nproc=N`` that many torchrun
    workers running it (the launcher is given the worker command; it imports no pipeline).
    ``values``: the config's typed values (:func:`~.run_values.parse_run_values`; parsed
    here when not given)."""
    from .run_values import parse_run_values
    from .runtime import distributed, metrics_sink

    values = values or parse_run_values(cfg)
    pipeline = importlib.import_module(sub.pipeline)
    nproc = distributed.requested_processes(cfg)
    if nproc == 1:
        with metrics_sink.logging_to(cfg, run_dir):
            return pipeline.run(cfg, Path(run_dir), values)
    if not pipeline.supports_distributed(cfg):
        raise ConfigError(
            f"distributed.nproc={nproc}: `cfbnn {sub.name}` with this configuration runs in one process; "
            "set distributed.nproc=1"
        )
    pipeline.validate(cfg)  # before starting N processes that would each fail alike
    worker = ["-m", "cfbnn_cli.cli", WORKER_FLAG, sub.config_name]
    return distributed.launch(cfg, run_dir, nproc, worker, device=values.device)


def _run_worker(argv: Sequence[str]) -> int:
    """``cfbnn --distributed-worker <config name> --config ... --run-dir ...``: one torchrun worker."""
    from .runtime import distributed

    sub = next((s for s in SUBCOMMANDS if argv and s.config_name == argv[0]), None)
    if sub is None:
        print(f"cfbnn: error: {WORKER_FLAG} needs one of {[s.config_name for s in SUBCOMMANDS]}", file=sys.stderr)
        return 2
    from .runtime import metrics_sink

    run = importlib.import_module(sub.pipeline).run

    def run_with_logger(cfg, run_dir):  # rank 0 writes the metrics, and their TensorBoard scalars
        with metrics_sink.logging_to(cfg, run_dir, enabled=distributed.is_main()):
            return run(cfg, run_dir)

    return distributed.run_worker(run_with_logger, list(argv[1:]))


def make_task(sub: Subcommand):
    """The Hydra task function for one subcommand."""

    def task(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig

        from .data.header_check import check_table_header
        from .report.results import write_results
        from .runtime.checks import validate_common
        from .runtime.made_dirs import made_by_this_run
        from .runtime.progress import progress_setting
        from .runtime.run_logs import LogsHeldBack, log_handlers_in
        from .runtime.rundir import (
            RunDirBusyError,
            RunDirLock,
            RunDirState,
            claim_run_dir,
            foreign_run_dir,
            refuse_finished_run,
        )
        from .runtime.safefs import UnsafePathError, unwritable_reason, writing_under
        from .runtime.threads import configure_threads, flush_denormals, tune_allocator

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        refuse_empty_output_dir(HydraConfig.get(), run_dir)
        # what the dir held before this run: a run that fails before writing any output leaves it so
        found = RunDirState(run_dir, made=made_by_this_run(run_dir), logs=log_handlers_in(run_dir))
        held_logs = LogsHeldBack(found.logs)  # the log is written only once this run holds the dir
        lock = RunDirLock(run_dir)
        flushed_before = None
        precision_before = None
        recorded = False  # results.json written: the dir now says what happened
        try:
            try:
                # a folder of other files, checked again here (the callback checked before Hydra wrote):
                # a sweep's job dir, or the callback turned off; the log Hydra just made there left out
                made_here = [Path(h.baseFilename).name for h in found.logs if getattr(h, "created", False)]
                foreign = foreign_run_dir(run_dir, sub.config_name, ignore=made_here)
                if foreign is not None:
                    raise ConfigError(foreign)
                # the checks that need no data, before the run dir is locked or touched: a typo
                # must not replace a finished run's records with a failed one's
                validate_common(cfg)
                progress_setting()
                check_table_header(cfg)  # data=csv: its header and the columns named, before torch loads
                from .run_values import parse_run_values  # (these import torch)
                from .runtime.device import set_matmul_precision

                importlib.import_module(sub.pipeline).validate(cfg)
                values = parse_run_values(cfg)  # device, estimator, likelihood: objects from here on
                refuse_finished_run(cfg, run_dir)  # read only; again under the lock in claim_run_dir
                with writing_under(run_dir):
                    lock.acquire()
                held_logs.release()
                # before any work: denormals flushed (inherited by the OpenMP threads created
                # next), threads shared with the other cfbnn jobs, memory kept for reuse
                flushed_before = flush_denormals(cfg.runtime.flush_denormals)
                configure_threads(cfg.runtime.threads)
                tune_allocator()
                # float32 matrix products on the GPU: full float32 (highest) or TF32 (high)
                precision_before = set_matmul_precision(cfg.runtime.matmul_precision)
                with writing_under(run_dir):
                    fingerprint, finished = claim_run_dir(cfg, run_dir, sub.config_name)
                if finished:
                    log.info(
                        "resume=true and %s/done exists for this configuration: this job already finished, skipping",
                        run_dir,
                    )
                    return
                with writing_under(run_dir):
                    _save_hydra_record(run_dir, cfg)
                started = time.perf_counter()
                try:
                    with writing_under(run_dir):  # no folder below the run dir is written through a link
                        result = run_pipeline(sub, cfg, run_dir, values)
                except CfbnnError as error:
                    if found.wrote_no_output():  # e.g. a missing or malformed data file: nothing to keep
                        raise
                    # the dir holds this run's outputs: say in it why the run failed
                    write_results(
                        run_dir,
                        pipeline=sub.config_name,
                        cfg=cfg,
                        metrics=getattr(error, "metrics", {}),  # a fit that learned nothing keeps its numbers
                        tables=getattr(error, "tables", {}),
                        status="failed",
                        wall_s=time.perf_counter() - started,
                        fingerprint=fingerprint,
                        error=str(error),
                    )
                    recorded = True
                    raise
                metrics = result.get("metrics", {})
                bad = _non_finite(metrics)
                write_results(
                    run_dir,
                    pipeline=sub.config_name,
                    cfg=cfg,
                    metrics=metrics,
                    tables=result.get("tables", {}),
                    figures=result.get("figures", {}),
                    device=values.device,
                    wall_s=time.perf_counter() - started,
                    fingerprint=fingerprint,
                    status="failed" if bad else "complete",
                )
                recorded = True
                if not bad:
                    print_outcome(run_dir, result)
                if bad:
                    raise NonFiniteResultError(
                        f"the run finished with non-finite metrics ({', '.join(bad[:8])}"
                        f'{", ..." if len(bad) > 8 else ""}): results.json says status "failed" and no `done` is '
                        f"written; check the data for extreme values or lower trainer.lr ({run_dir})"
                    )
            except UnsafePathError as error:  # a link or a foreign folder met while writing
                raise ConfigError(str(error)) from None
            except OSError as error:  # a folder or file of the run that cannot be made or written
                unwritable = unwritable_reason(error)
                if unwritable is None:
                    raise
                raise ConfigError(unwritable_line(unwritable, run_dir)) from None
        except CfbnnError as error:
            if not lock.held:
                # refused before this run held the dir (another run may be writing there): stderr only,
                # nothing in the dir touched; where nothing was written, the dir as it was
                held_logs.drop()
                if isinstance(error, RunDirBusyError):  # only the empty log this run made goes
                    found.leave_as_found(lock, folders=False)
                elif found.wrote_no_output():
                    found.leave_as_found(lock)
                print(f"cfbnn: error: {error}", file=sys.stderr, flush=True)
            elif not recorded and found.wrote_no_output():
                # refused before any output: the dir as it was (none where this run made it), the
                # reason on stderr only
                found.leave_as_found(lock)
                print(f"cfbnn: error: {one_line(error)}", file=sys.stderr, flush=True)
            else:
                _report_error(error)
            error.reported = True
            raise
        finally:  # as it was (a multirun or a test runs more in this process)
            held_logs.drop()
            lock.release()
            if flushed_before is not None:
                flush_denormals(flushed_before)
            if precision_before is not None:
                set_matmul_precision(precision_before)

    task.__name__ = sub.config_name
    return task


def _before_torch_loads() -> None:
    """OpenMP reads its settings once, when torch loads it: spin briefly (GOMP_SPINCOUNT) before
    sleeping, so that idle threads of one job do not steal the cores of another running
    beside it (two concurrent jobs on 2 cores: 4.3x -> 1.45x their time alone, no cost
    alone; benchmarks/bench_threads.py). A user's own OpenMP settings win."""
    if not any(key in os.environ for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")):
        os.environ["GOMP_SPINCOUNT"] = "10000"


def _predict(argv: List[str]) -> int:
    """``cfbnn predict RUN_DIR FILE``: the run's own kind of prediction -- an ``imagenet-predict``
    run (its ``head.pt``) classifies new features, any other run (or a model file) is read as a
    ``train regression`` or ``train classification`` model (``model.pt``; the error says so
    where it is not one)."""
    run_dir = next((a for a in argv if not a.startswith("-")), None)
    if run_dir is not None and (Path(run_dir) / "head.pt").is_file():
        from .pipelines.imagenet.predict_new import main as classify

        return classify(argv)
    from .pipelines.predict import main as tabular

    return tabular(argv)


INTERRUPTED = "cfbnn: interrupted"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The ``cfbnn`` command. Whatever it does, it ends in one of three ways: its outcome, one line
    of error, or -- on Ctrl-C at any moment, a module still importing included -- one line and exit
    130; library warnings are shown (one line each) only after a success (:mod:`.runtime.held_warnings`)."""
    from .runtime.held_warnings import holding_warnings

    handler = signal.getsignal(signal.SIGINT)
    if handler is _interrupted_while_starting:
        handler = signal.default_int_handler
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a KeyboardInterrupt, caught below
    code = 1
    try:
        with holding_warnings() as held:
            try:
                _main(argv)
                code = 0
            except SystemExit as exit:
                code = exit.code
            except KeyboardInterrupt:  # where the command itself did not say what was kept
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the goodbye
                print(INTERRUPTED, file=sys.stderr, flush=True)
                code = 130
            except BrokenPipeError:  # `cfbnn ... | head`: the reader left; no traceback for it
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                code = 1
        if code in (0, None):
            held.show()
    except KeyboardInterrupt:  # between the lines above
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(INTERRUPTED, file=sys.stderr, flush=True)
        code = 130
    if argv is None:  # the command's own process: a Ctrl-C while it exits is ignored, not a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    elif handler is not None:  # called in a process that goes on (a test, a script): its handler back
        signal.signal(signal.SIGINT, handler)
    sys.exit(code)


def _main(argv: Optional[Sequence[str]] = None) -> None:
    _before_torch_loads()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a usage error: the usage goes where errors go
        print(usage(), end="", file=sys.stderr)
        sys.exit(2)
    if argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        sys.exit(0)
    if argv[0] == "report":
        from .report.aggregate import main as report_main

        sys.exit(report_main(argv[1:]))
    if argv[0] == "completion":
        from .completion import script

        try:
            print(script(argv[1] if len(argv) > 1 else "bash"), end="")
        except ValueError as error:
            print(f"cfbnn: error: {error}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    if argv[0] == "predict":
        sys.exit(_predict(argv[1:]))
    if argv[0] == WORKER_FLAG:
        sys.exit(_run_worker(argv[1:]))
    if argv[0] == "--version":
        from . import __version__

        print(f"cfbnn {__version__}")
        sys.exit(0)
    sub, rest = find_subcommand(argv)
    if sub is None:
        completions = [s.name for s in SUBCOMMANDS if len(s.words) > 1 and s.words[0] == argv[0]]
        if completions:
            print(
                f"cfbnn: error: incomplete command {argv[0]!r}; did you mean {' or '.join(completions)!r}?\n",
                file=sys.stderr,
            )
        else:
            print(f"cfbnn: error: unknown command {' '.join(argv[:2])!r}\n", file=sys.stderr)
        print(usage(), end="", file=sys.stderr)
        sys.exit(2)
    if any(a in ("-sc", "--shell-completion") for a in rest) and any(a.startswith("install=") for a in rest):
        # Hydra's installer registers one program name: two-word commands need cfbnn's own script
        from .completion import script

        print(script("bash"), end="")
        sys.exit(0)
    try:
        conf = config_dir()
    except CfbnnError as error:
        print(f"cfbnn: error: {one_line(error)}", file=sys.stderr)
        sys.exit(error.exit_code)

    sys.exit(_run_hydra(sub, conf, rest))


def _run_hydra(sub: Subcommand, conf: Path, rest: List[str]) -> int:
    """Run the subcommand's Hydra app and map every failure to one message and an exit code:
    a :class:`CfbnnError` to its own (2 for configuration errors), Hydra's composition
    and override errors (``data=nope``, an unknown key) to 2, anything else to 1 with
    its traceback. ``HYDRA_FULL_ERROR=1`` re-raises instead, as Hydra does."""
    import traceback

    import hydra
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    from .runtime.made_dirs import forget
    from .runtime.safefs import shown_path, unwritable_message, unwritable_reason

    forget()  # what an earlier command in this process noted about its dirs
    rest, refused = hydra_arguments(sub, rest)  # `-m` after the overrides works too
    if refused is None:
        try:  # a data=csv table's header, from the plain overrides, before Hydra and torch load
            from .data.header_check import check_command_line

            check_command_line(rest)
        except CfbnnError as error:
            print(f"cfbnn: error: {one_line(error)}", file=sys.stderr)
            return error.exit_code
    refused = refused or unread_addition(sub, conf, rest, compose_config) or empty_output_dir_override(rest)
    if refused is not None:
        print(f"cfbnn: error: {refused}", file=sys.stderr)
        return 2
    user_wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Hydra's own handler would print and exit 1 for every error; let them reach us instead
    os.environ["HYDRA_FULL_ERROR"] = "1"
    # Hydra reads sys.argv; give it only the arguments after the subcommand, and the shared configs'
    # folder as an extra config dir: `hydra.searchpath` alone finds them when composing, but --help
    # lists the groups ($APP_CONFIG_GROUPS) of the search path Hydra starts with (`logger` lives there)
    sys.argv = [f"cfbnn {sub.name}", f"--config-dir={conf / 'shared'}"] + rest
    _point_hydra_at_shared_configs(conf)
    stderr = sys.stderr
    sys.stderr = WithoutHydraJobError(stderr)
    try:
        hydra.main(config_path=str(conf / sub.config_name), config_name=sub.config_name, version_base="1.3")(
            make_task(sub)
        )()
    except SystemExit as exit:
        if exit.code not in (0, None) and mentions_launcher(rest):
            print(LAUNCHER_HINT, file=sys.stderr)
        raise
    except CfbnnError as error:
        if user_wants_traceback:
            raise
        if not getattr(error, "reported", False):
            print(f"cfbnn: error: {one_line(error)}", file=sys.stderr)
        return error.exit_code
    except (CompactHydraException, OmegaConfBaseException) as error:
        if user_wants_traceback:
            raise
        unknown = unknown_key_message(error, sub)
        if unknown is not None:  # one line, as for every other bad value
            print(f"cfbnn: error: {unknown}", file=sys.stderr)
            return 2
        override = getattr(error, "override", None)  # an OverrideParseException knows the override
        where = f" in the override {one_line(override, 200)!r}" if override else ""
        print(f"cfbnn: error{where}: {hydra_message(error)}", file=sys.stderr)
        if mentions_launcher(rest):
            print(LAUNCHER_HINT, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if user_wants_traceback:
            raise
        from .runtime.checkpoints import last_saved

        kept = last_saved()  # only a checkpoint this run wrote is promised
        print(
            f"cfbnn: interrupted; the last checkpoint ({kept}) is kept: rerun with resume=true to continue"
            if kept is not None
            else "cfbnn: interrupted before the first checkpoint was written: nothing to resume; rerun to start again",
            file=sys.stderr,
        )
        return 130
    except Exception as error:  # a bug, not a user error: the traceback helps
        if user_wants_traceback:
            raise
        refused = unsafe_path_in(error)
        if refused is not None:  # a link or a foreign folder met while Hydra set logging up
            print(f"cfbnn: error: {refused}", file=sys.stderr)
            return 2
        if isinstance(error, (FileExistsError, NotADirectoryError)):  # Hydra making the run dir
            print(
                f"cfbnn: error: cannot make the output folder {shown_path(error.filename)}: a file is in the way; "
                "choose another hydra.run.dir (or move the file)",
                file=sys.stderr,
            )
            return 2
        unwritable = unwritable_reason(error)
        if unwritable is not None:  # Hydra making the run dir or opening its log
            print(
                "cfbnn: error: "
                + unwritable_message(
                    unwritable,
                    "choose a hydra.run.dir you can write (hydra.sweep.dir for a sweep), or fix that folder's "
                    "permissions",
                ),
                file=sys.stderr,
            )
            return 2
        traceback.print_exc()
        if mentions_launcher(rest):
            print(LAUNCHER_HINT, file=sys.stderr)
        return 1
    finally:
        sys.stderr = stderr
        if not user_wants_traceback:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    return 0


if __name__ == "__main__":  # pragma: no cover
    main()
