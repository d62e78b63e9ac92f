"""`cfbnn vae`: a VAE with a Bayesian decoder, variants v1/v2/v3 (paper Table 2).

``run(cfg, run_dir) -> dict``; no Hydra here. For each variant (``variant=all``
trains the three in one run; ``variant=v1|v2|v3`` one, for sweeps) it trains with
Adam on minibatches of the 7:2:1 train split, evaluates the validation ELBO after
every epoch and keeps the best epoch's checkpoint (``checkpoints/<variant>/best.pt``;
``last.pt`` every epoch, both atomic; ``resume=true`` continues); it stops when the
validation ELBO has not improved for ``trainer.patience`` epochs or after
``trainer.epochs`` (the cap), whichever comes first. It then estimates the
test log-likelihood of the best checkpoint by importance weighting (paper protocol:
``evaluation.inner_samples`` K inside the log, averaged over ``evaluation.trials``
T trials; see :meth:`cfbnn_cli.bnn.vae.BayesianDecoderVAE.importance_weighted_log_likelihood`
for what it estimates), in the data's original units.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Dict, List, Optional

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from ..bnn.footprint import parameter_count, per_row_floats, training_bytes
from ..bnn.vae import VARIANTS, BayesianDecoderVAE
from ..data.unsupervised import UnsupervisedData, load_unsupervised_data
from ..moments import ACTIVATIONS, validate_args
from ..report.figures import caption, legend_below, new_figure, save_figure
from ..report.metric_keys import vae_key
from ..report.numbers import format_mean_se, format_value
from ..report.tables import write_table
from ..run_values import RunValues, parse_run_values
from ..runtime.checks import (
    MAX_WEIGHTS,
    MAX_WIDTH,
    require_choice,
    require_int,
    require_positive_float,
    require_present_bounds,
    require_table_size,
    require_widths,
)
from ..runtime.cuda_graphs import GraphedCall
from ..runtime.errors import ConfigError
from ..runtime.memory import require_memory
from ..runtime.progress import progress_bar
from ..runtime.seed import seed_everything
from ..train import TrainingLoop, loop_from_config, optimizers

log = logging.getLogger(__name__)
VARIANT_CHOICES = ["all", *VARIANTS]


def validate(cfg: DictConfig) -> List[str]:
    """Every check that needs no data; returns the variants to train."""
    variant = require_choice(cfg, "variant", VARIANT_CHOICES)
    require_int(cfg, "model.latent_dim", minimum=1)
    require_int(cfg, "model.decoder_hidden", minimum=1)
    require_widths(cfg, "model.encoder_hidden", example="[500,500]")
    require_present_bounds(
        cfg,
        {
            "data.input_dim": 1,
            "data.rows": 10,
            "data.latent_dim": 1,
            "data.teacher_hidden": 1,
            "data.expected_rows": 10,
            "data.components": 1,
        },
        seeds=["data.seed"],
        nonnegative=["data.noise_std"],
    )
    floor = OmegaConf.select(cfg, "data.std_floor", default=None)
    if floor is not None and floor != "pooled":
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 < floor < math.inf:
            raise ConfigError(
                f"data.std_floor={floor!r} must be pooled, a positive number (in the data's units) or null (no floor)"
            )
    for key in ("data.input_dim", "data.latent_dim", "data.teacher_hidden"):
        if OmegaConf.select(cfg, key, default=None) is not None:
            require_int(cfg, key, minimum=1, maximum=MAX_WIDTH, why=" (the width of a layer)")
    require_table_size(cfg, ["data.rows"], "data.input_dim")
    require_table_size(cfg, ["data.rows"], "data.latent_dim")
    require_table_size(cfg, ["data.rows"], "data.teacher_hidden")
    width = OmegaConf.select(cfg, "data.input_dim", default=None)
    decoder = [cfg.model.latent_dim, cfg.model.decoder_hidden] + ([width] if isinstance(width, int) else [])
    if sum(a * b for a, b in zip(decoder[:-1], decoder[1:])) > MAX_WEIGHTS:
        raise ConfigError(
            f"model.latent_dim={cfg.model.latent_dim}, model.decoder_hidden={cfg.model.decoder_hidden} ask for more "
            f"than {MAX_WEIGHTS:,} decoder weights; lower them"
        )
    require_choice(cfg, "model.activation", sorted(ACTIVATIONS))
    require_positive_float(cfg, "model.prior_scale")
    require_positive_float(cfg, "model.init_scale")
    require_int(cfg, "evaluation.inner_samples", minimum=1)
    require_int(cfg, "evaluation.trials", minimum=1)
    require_int(cfg, "evaluation.batch_size", minimum=1)
    if not isinstance(OmegaConf.select(cfg, "evaluation.posterior_mean_reading", default=False), bool):
        raise ConfigError(
            f"evaluation.posterior_mean_reading={cfg.evaluation.posterior_mean_reading!r} must be true or false"
        )
    if OmegaConf.select(cfg, "trainer.patience") is not None:
        require_int(cfg, "trainer.patience", minimum=1)
    if not isinstance(cfg.trainer.compile, bool):
        raise ConfigError(f"trainer.compile={cfg.trainer.compile!r} must be true or false")
    return list(VARIANTS) if variant == "all" else [variant]


def _build(cfg, data_dim, variant, generator) -> BayesianDecoderVAE:
    m = cfg.model
    return BayesianDecoderVAE(
        data_dim,
        m.latent_dim,
        list(m.encoder_hidden),
        m.decoder_hidden,
        variant,
        m.activation,
        m.prior_scale,
        m.init_scale,
        generator=generator,
    )


@torch.no_grad()
def mean_elbo_per_point(model, x, num_train: int, seed: int, batch_size: int) -> float:
    """The ELBO per point on ``x``: the training objective's per-point share, i.e. the
    weight KL spread over the ``num_train`` training rows (fixed noise seed)."""
    terms = elbo_terms(model, x, num_train, seed, batch_size)
    return terms["elbo"]


@torch.no_grad()
def elbo_terms(model, x, num_train: int, seed: int, batch_size: int) -> Dict[str, float]:
    """The ELBO per point on ``x`` and its three terms (in the units the model sees):
    ``ell`` = mean ``E_q[log p(x_n | z, W)]`` (one ``z`` per point), ``kl_z`` = mean
    ``KL(q(z|x_n) || p(z))``, ``kl_w`` = ``KL(q(W) || p(W)) / num_train`` (the weight KL
    spread over the training rows, as in the training objective; 0 for V1);
    ``elbo = ell - kl_z - kl_w``."""
    generator = torch.Generator(device=x.device).manual_seed(seed)
    ell = kl_z = 0.0
    for i in range(0, len(x), batch_size):
        e, k = model.elbo_terms_per_point(x[i : i + batch_size], generator)
        ell, kl_z = ell + float(e.sum()), kl_z + float(k.sum())
    ell, kl_z, kl_w = ell / len(x), kl_z / len(x), float(model.weight_kl()) / num_train
    return {"ell": ell, "kl_z": kl_z, "kl_w": kl_w, "elbo": ell - kl_z - kl_w}


@torch.no_grad()
def importance_weighted_test_ll(
    model,
    x,
    inner_samples: int,
    trials: int,
    batch_size: int,
    seed: int,
    progress=None,
    cuda_graphs: bool = True,
    decoder_weights: str = "sampled",
):
    """Per-trial mean over ``x`` of the K-sample importance-weighted log-likelihood: ``(T,)``;
    ``decoder_weights`` as in :meth:`~cfbnn_cli.bnn.vae.BayesianDecoderVAE.importance_weighted_log_likelihood`.

    On CUDA each chunk's estimate is one CUDA graph (its draws from ``seed``'s generator,
    registered with the graph) and the sums stay on the device: one synchronization per trial."""
    generator = torch.Generator(device=x.device).manual_seed(seed)
    chunk = max(1, batch_size // max(1, inner_samples // 10))  # keep K x chunk x hidden bounded
    chunk_sum = GraphedCall(
        lambda rows: model.importance_weighted_log_likelihood(rows, inner_samples, generator, decoder_weights).sum(),
        x.device,
        generators=(generator,),
        label="importance-weighted evaluation",
        enabled=cuda_graphs,
    )
    values = []
    with validate_args(False):  # argument checks would wait for the GPU inside the graph
        for _ in range(trials):
            total = torch.zeros((), dtype=torch.float64, device=x.device)
            for i in range(0, len(x), chunk):
                total = total + chunk_sum(x[i : i + chunk]).double()  # each chunk's sum as before, in float64
            values.append(float(total) / len(x))
            if progress is not None:
                progress.update(1)
    return torch.tensor(values, dtype=torch.float64)


def _test_ll_trials(cfg, model, data: UnsupervisedData, label: str, decoder_weights: str) -> torch.Tensor:
    """The ``evaluation.trials`` trials of the test LL (one reading), in original units."""
    with progress_bar(total=cfg.evaluation.trials, desc=label, leave=False) as bar:
        trials = importance_weighted_test_ll(
            model,
            data.x_test,
            cfg.evaluation.inner_samples,
            cfg.evaluation.trials,
            cfg.evaluation.batch_size,
            cfg.seed + 3,
            bar,
            cuda_graphs=cfg.trainer.cuda_graphs,
            decoder_weights=decoder_weights,
        )
    return trials - data.log_scale


def _train_variant(cfg, variant: str, data: UnsupervisedData, device, run_dir: Path, earlier_rows: List[dict]) -> Dict:
    generator = seed_everything(cfg.seed)
    model = _build(cfg, data.dim, variant, generator).to(device)
    optimizer = optimizers.adam(model.parameters(), lr=cfg.trainer.lr)
    sampler = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    x_train = data.x_train
    num_data = len(x_train)

    def negative_elbo_per_point(batch):
        # per data point, so that trainer.lr means the same for any data size
        return -model.elbo(batch, num_data, sampler) / num_data

    if cfg.trainer.compile:
        # fuses the closed form's elementwise work (on an H200: v3 1.90x -> 1.35x the eager v1 step)
        negative_elbo_per_point = torch.compile(negative_elbo_per_point)

    def validation_elbo(epoch):
        return {
            "val_elbo_per_point": mean_elbo_per_point(
                model, data.x_val, num_data, cfg.seed + 2, cfg.evaluation.batch_size
            )
        }

    # epoch_cap: the bar shows the cap, not the epoch run one at a time; log_summary: said once below,
    # not after every epoch
    options = dict(
        checkpoint_dir=run_dir / "checkpoints" / variant,
        evaluate=validation_elbo,
        select=("val_elbo_per_point", "max"),
        metrics_prefix=earlier_rows,
        row_fields={"variant": variant},
        label=variant,
        epoch_cap=cfg.trainer.epochs,
        log_summary=False,
    )
    loop = loop_from_config(
        cfg,
        run_dir,
        model,
        optimizer,
        lambda rows: negative_elbo_per_point(x_train[rows]),
        num_data,
        device,
        generator,
        sampler,
        **options,
    )
    loop.restore()
    stopped = train_with_patience(loop, cfg.trainer.epochs, OmegaConf.select(cfg, "trainer.patience"))
    if loop.history:
        why = "the cap" if stopped == "cap" else f"no gain in {cfg.trainer.patience} epochs"
        log.info("%s (stopped: %s)", loop.summary(), why)
    loop.load_best()
    model.eval()
    return {"model": model, "history": list(loop.history), "best": dict(loop.best), "stopped": stopped}


def train_with_patience(loop: TrainingLoop, max_epochs: int, patience) -> str:
    """Train ``loop`` one epoch at a time until the selected metric has not improved for
    ``patience`` epochs, or ``max_epochs`` (the cap) are done; returns why it stopped
    (``"patience"`` or ``"cap"``). Each epoch is the loop's own (checkpoints, metrics,
    resume): after a restore it continues where the run stopped, and a run that
    already met the rule trains nothing more."""
    while True:
        done = loop.history[-1]["epoch"] if loop.history else 0
        if patience and loop.best["epoch"] >= 1 and done - loop.best["epoch"] >= patience:
            return "patience"
        if done >= max_epochs:
            return "cap"
        loop.start_epoch, loop.epochs = done, done + 1
        loop.run()


TEST_LL_COLUMN = "Test LL"


def results_table(rows: List[dict], trials: int) -> pd.DataFrame:
    """Paper Table 2 layout plus the ELBO's terms: variant, Bayesian decoder, what is
    sampled, test LL (± s.e. over the ``trials`` evaluation trials of this one run),
    test ELBO = E[log p(x|z,W)] − KL(z) − KL(W)/N, the epochs. Per test point, in the
    data's original units (the log-likelihood terms; the KLs have no units)."""
    frame = pd.DataFrame(
        [
            {
                "Variant": row["variant"].upper(),
                "Bayesian decoder": "yes" if VARIANTS[row["variant"]]["bayesian"] else "no",
                "Sampled": VARIANTS[row["variant"]]["sampled"],
                f"{TEST_LL_COLUMN} (± s.e., {trials} trials)": format_mean_se(row["test_ll"], row["test_ll_se"], sig=5),
                **(
                    {
                        "Test LL, weights at posterior mean": format_mean_se(
                            row["test_ll_posterior_mean"], row["test_ll_posterior_mean_se"], sig=5
                        )
                    }
                    if row.get("test_ll_posterior_mean") is not None
                    else {}
                ),
                "Test ELBO": format_value(row["test_elbo"], sig=5),
                "E[log p(x|z,W)]": format_value(row["test_ell"], sig=5),
                "KL(z)": format_value(row["test_kl_z"], sig=3),
                "KL(W) / N": format_value(row["test_kl_w"], sig=3),
                "Best epoch": row["best_epoch"],
                "Epochs": f"{row['epochs']} ({'stopped: no gain in ' + str(row['patience']) if row['stopped'] == 'patience' else 'cap'})",
                "s / epoch": format_value(row["seconds_per_epoch"], sig=2)
                if row["seconds_per_epoch"] is not None
                else "",
            }
            for row in rows
        ]
    )
    return frame.set_index("Variant")


# each variant's numbers: results.json's vae/<variant>/<key> metrics and vae_results.csv's columns
RESULT_METRICS = (
    "test_ll",
    "test_ll_se",
    "test_ll_posterior_mean",
    "test_ll_posterior_mean_se",
    "test_elbo",
    "test_ell",
    "test_kl_z",
    "test_kl_w",
    "best_epoch",
    "epochs",
    "seconds_per_epoch",
)


def results_data(rows: List[dict], trials: int) -> pd.DataFrame:
    """The numbers of :func:`results_table`, one per column (``vae_results.csv``): the test LL
    and its s.e. over the ``trials`` evaluation trials, the ELBO's terms, the best epoch, the
    epochs run and why training stopped (``patience`` or ``cap``)."""
    columns = [*RESULT_METRICS, "stopped", "patience"]
    return pd.DataFrame(
        [
            {
                "variant": row["variant"],
                "bayesian_decoder": VARIANTS[row["variant"]]["bayesian"],
                "trials": trials,
                **{column: row.get(column) for column in columns},
            }
            for row in rows
        ]
    )


VARIANT_STYLE = {
    "v1": dict(ls="-", marker=None, color="C0"),
    "v2": dict(ls="--", marker="o", color="C1"),
    "v3": dict(ls=":", marker="s", color="C2"),
}


# what each variant's ELBO holds: V1's decoder weights are point estimates (no weight KL); V2's and V3's
# ELBO subtracts the decoder weights' KL spread over the training rows, so the curves differ by it
ELBO_LABELS = {
    "v1": "V1: E[log p(x|z)] − KL(z)",
    "v2": "V2: E[log p(x|z,W)] − KL(z) − KL(W)/N",
    "v3": "V3: E[log p(x|z,W)] − KL(z) − KL(W)/N",
}


def _plot_training(history: List[dict], path: Path, log_scale: float, title: str) -> str:
    """Train and validation ELBO per point (original units) of each variant; the best epoch marked."""
    fig, axes = new_figure(2, width=7.0, height=3.0)
    frame = pd.DataFrame(history)
    for variant, part in frame.groupby("variant", sort=True):
        style = dict(VARIANT_STYLE.get(variant, {}))
        every = max(1, len(part) // 8)
        for ax, column in zip(axes, ("train_elbo_per_point", "val_elbo_per_point")):
            ax.plot(
                part["epoch"],
                part[column] - log_scale,
                lw=1.4,
                ms=4,
                markevery=every,
                mfc="none",
                label=ELBO_LABELS.get(variant, variant.upper()),
                **style,
            )
        best = part.loc[part["val_elbo_per_point"].idxmax()]
        axes[1].plot(
            [best["epoch"]],
            [best["val_elbo_per_point"] - log_scale],
            marker="*",
            ms=10,
            color=style.get("color"),
            ls="none",
        )
    axes[1].plot([], [], marker="*", ms=8, color="0.3", ls="none", label="best epoch (validation)")
    axes[0].set_ylabel("train ELBO per point\n(original units, nats)")
    axes[1].set_ylabel("validation ELBO per point\n(original units, nats)")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    legend_below(fig, axes)
    caption(
        fig,
        f"{title}. V1's ELBO has no weight KL (a point-estimate decoder); V2's and V3's subtract "
        "the decoder weights' KL / N (N training rows), so their curves sit below V1's by that much "
        "even at an equal fit",
    )
    return save_figure(fig, path)


def supports_distributed(cfg: DictConfig) -> bool:
    """The VAE trains in one process."""
    return False


def _require_memory(cfg, data_dim: int) -> None:
    """The networks and a minibatch's activations, counted before anything is built: the Bayesian
    decoder (latent -> ``model.decoder_hidden`` -> the data, its means and scales) and the encoder's
    point weights (the data -> ``model.encoder_hidden`` -> the latent's mean and scale), under Adam."""
    m = cfg.model
    encoder = [int(data_dim), *[int(h) for h in m.encoder_hidden], 2 * int(m.latent_dim)]
    encoder_weights = sum((a + 1) * b for a, b in zip(encoder[:-1], encoder[1:]))
    decoder = (int(m.latent_dim), [int(m.decoder_hidden)], int(data_dim))
    parameters = parameter_count(*decoder) + encoder_weights
    floats = per_row_floats(*decoder) + sum(encoder[1:])
    require_memory(
        training_bytes(parameters, int(cfg.trainer.batch_size), floats, "adam"),
        f"model.encoder_hidden={list(encoder[1:-1])}, model.decoder_hidden={m.decoder_hidden} on {data_dim} "
        f"dimensions ({parameters:,} parameters) with trainer.batch_size={cfg.trainer.batch_size}",
        "lower model.decoder_hidden or model.encoder_hidden",
    )


def run(cfg: DictConfig, run_dir, values: Optional[RunValues] = None) -> dict:
    run_dir = Path(run_dir)
    variants = validate(cfg)
    values = values or parse_run_values(cfg)  # the typed values (the CLI passes them)
    device = values.device
    data = load_unsupervised_data(cfg.data)
    if cfg.trainer.batch_size > len(data.x_train):
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} exceeds the {len(data.x_train)} training rows; lower it"
        )
    _require_memory(cfg, data.x_train.shape[1])
    data.x_train, data.x_val, data.x_test = data.x_train.to(device), data.x_val.to(device), data.x_test.to(device)
    log.info(
        "VAE on %s (%d train / %d validation / %d test rows, %d dims), variants %s, device=%s",
        data.name,
        len(data.x_train),
        len(data.x_val),
        len(data.x_test),
        data.dim,
        variants,
        device,
    )
    for key, value in data.details.items():
        log.info("%s: %s = %.4f", data.name, key, value)
    history: List[dict] = []
    rows: List[dict] = []
    K, T = cfg.evaluation.inner_samples, cfg.evaluation.trials
    num_train = len(data.x_train)
    with validate_args(False):
        for variant in variants:
            trained = _train_variant(cfg, variant, data, device, run_dir, list(history))
            history.extend(trained["history"])
            trials = _test_ll_trials(cfg, trained["model"], data, f"{variant} test LL (K={K})", "sampled")
            plug_in = None
            if OmegaConf.select(cfg, "evaluation.posterior_mean_reading", default=False):
                plug_in = (
                    _test_ll_trials(
                        cfg, trained["model"], data, f"{variant} test LL, weights at posterior mean", "posterior_mean"
                    )
                    if trained["model"].bayesian
                    else trials  # a point-estimate decoder: the two readings are one
                )
            seconds = [h["epoch_seconds"] for h in trained["history"]]
            terms = elbo_terms(trained["model"], data.x_test, num_train, cfg.seed + 4, cfg.evaluation.batch_size)
            rows.append(
                {
                    "variant": variant,
                    "test_ll": float(trials.mean()),
                    "test_ll_se": float(trials.std() / math.sqrt(T)) if T > 1 else None,
                    "test_ll_posterior_mean": float(plug_in.mean()) if plug_in is not None else None,
                    "test_ll_posterior_mean_se": float(plug_in.std() / math.sqrt(T))
                    if plug_in is not None and T > 1
                    else None,
                    "test_elbo": terms["elbo"] - data.log_scale,
                    "test_ell": terms["ell"] - data.log_scale,
                    "test_kl_z": terms["kl_z"],
                    "test_kl_w": terms["kl_w"],
                    "best_epoch": trained["best"]["epoch"],
                    "epochs": trained["history"][-1]["epoch"] if trained["history"] else 0,
                    "stopped": trained["stopped"],
                    "patience": OmegaConf.select(cfg, "trainer.patience"),
                    "seconds_per_epoch": sum(seconds) / len(seconds) if seconds else None,
                }
            )
            log.info(
                "%s: test LL %.3f (K=%d, T=%d), test ELBO %.3f = E[log p] %.3f - KL(z) %.3f - KL(W)/N %.3f, "
                "best epoch %d of %d (%s)",
                variant,
                rows[-1]["test_ll"],
                K,
                T,
                rows[-1]["test_elbo"],
                rows[-1]["test_ell"],
                rows[-1]["test_kl_z"],
                rows[-1]["test_kl_w"],
                rows[-1]["best_epoch"],
                rows[-1]["epochs"],
                trained["stopped"],
            )
    table = results_table(rows, T)
    caption = (
        f"VAE on {data.name} ({num_train} training rows, {len(data.x_test)} test rows, {data.dim} dims), seed "
        f"{cfg.seed}: test log-likelihood per point in original units (importance weighted, K={K} samples "
        f"inside the log, ± s.e. over T={T} trials of this one run: it leaves out the training seed's spread, "
        f"see cfbnn report over seeds); Test ELBO = E[log p(x|z,W)] − KL(z) − KL(W)/N, N = {num_train}; the "
        f"gap between Test ELBO and Test LL is mostly KL(W)/N, the decoder-weight KL shared by the training "
        f"rows (0 for V1)"
    )
    tables = write_table(table, run_dir, "vae_results", caption=caption, data=results_data(rows, T))
    log.debug("VAE results on %s:\n%s", data.name, table.to_markdown())
    title = (
        f"VAE on {data.name} ({num_train} training rows), batch {cfg.trainer.batch_size}, lr {cfg.trainer.lr}, "
        f"seed {cfg.seed}"
    )
    figures = {"training": _plot_training(history, run_dir / "training.png", data.log_scale, title)} if history else {}
    metrics = {f"data/{key}": value for key, value in data.details.items()}
    for row in rows:
        for key in RESULT_METRICS:
            if row[key] is not None or not key.startswith("test_ll_posterior_mean"):
                metrics[vae_key(row["variant"], f"{key}")] = row[key]
    return {"metrics": metrics, "tables": tables, "figures": figures, "device": device, "main_table": "vae_results.md"}
