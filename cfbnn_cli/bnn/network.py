"""The paper's network, in one place: a stack of weight layers, each with its treatment.

``x -> W_1 -> g -> W_2 -> g -> ... -> W_L -> outputs``, biases through an input column
of ones on every layer (paper footnote 1; ``output_bias=False`` drops it on the last
layer). Every weight matrix is a layer object (:mod:`.layers`): a
:class:`~.layers.GaussianMatrix` (Bayesian; covariance ``diagonal``, ``full`` or ``lowrank``;
prior ``N(0, s^2 I)`` with ``s`` fixed or, ``prior="empirical_bayes"``, at its ELBO optimum
per layer) or a :class:`~.layers.PointLinear` (a point estimate: the maximum-likelihood layer
of the Figure 1 head, the decoder of VAE variant V1, the plain-MLP baseline).

Point layers come first (``point_layers`` of them), Gaussian layers after. Which Gaussian
layers are integrated and which sampled is the *estimator* (:mod:`.estimators`), an object
passed to each method (or its name: ``analytic``, ``integrate_output_layer``, ``sampling``,
``deterministic``, ``deterministic_full``), so that one set of parameters can be trained or
measured with any of them. The likelihood is a separate object (:mod:`.likelihoods`).

:class:`ClosedFormBNN` is the paper's one-hidden-layer network ``x -> A x -> g(A x) -> B
g(A x)`` with the constructor of the paper's notation; :func:`bayesian_head` Figure 1's head.
Every method takes its options by keyword.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..moments import get_activation
from ..moments.activations import family_of
from ..moments.predict_ops import NO_ACTIVATION
from ..moments.relu_family import std_from_variance
from .estimators import ESTIMATORS, ClosedForm, Estimator, LocalReparameterization, make_estimator
from .functional import augment
from .input_checks import check_count, check_inputs, check_num_data
from .layers import COVARIANCES, GaussianMatrix, Layer, PointLinear
from .likelihoods import (
    LIKELIHOODS,
    CategoricalLikelihood,
    HeteroscedasticNormalLikelihood,
    NormalLikelihood,
    make_likelihood,
)
from .predictive import class_distribution, predictive, predictive_components

__all__ = [
    "COVARIANCES",
    "ESTIMATORS",
    "PRIORS",
    "BayesianNetwork",
    "ClosedFormBNN",
    "GaussianMatrix",
    "Layer",
    "PointLinear",
    "bayesian_head",
]

PRIORS = ("fixed", "empirical_bayes")
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth")
EstimatorLike = Union[Estimator, str]


def _check_likelihood_outputs(likelihood, output_dim: int) -> None:
    """The likelihood's number of network outputs against ``output_dim``."""
    outputs = getattr(likelihood, "outputs", None)  # (the heteroscedastic Normal's mean and log-variance)
    if outputs is not None and output_dim != outputs:
        raise ValueError(
            f"`output_dim` must be {outputs} for {type(likelihood).__name__} (its outputs); got {output_dim}"
        )
    if isinstance(likelihood, CategoricalLikelihood):
        if likelihood.logistic and output_dim != 1:
            raise ValueError(f"`output_dim` must be 1 for the logistic likelihood (one logit); got {output_dim}")
        if not likelihood.logistic and output_dim < 2:
            raise ValueError(
                f"`output_dim` is the number of classes of the softmax likelihood, at least 2; got {output_dim} "
                "(for two classes with one logit use the logistic likelihood)"
            )


class BayesianNetwork(nn.Module):
    """``D -> H_1 -> ... -> H_L -> O``: ``point_layers`` point layers, then Gaussian layers.

    Outputs are ``(..., N)`` for ``output_dim = 1`` and ``(..., N, O)`` otherwise.
    ``covariance`` is one name for every Gaussian layer or a list with one per Gaussian
    layer; the output layer's must be ``diagonal`` or ``full``.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_sizes: Sequence[int],
        output_dim: int = 1,
        activation="relu",
        covariance: Union[str, Sequence[str]] = "diagonal",
        rank: int = 10,
        prior_scale: float = 1.0,
        init_scale: float = 1e-2,
        likelihood: Optional[nn.Module] = None,
        point_layers: int = 0,
        output_bias: bool = True,
        generator: Optional[torch.Generator] = None,
        prior: str = "fixed",
    ):
        super().__init__()
        if prior not in PRIORS:
            raise ValueError(f"`prior` must be one of {PRIORS}; got {prior!r}")
        hidden_sizes = [int(h) for h in hidden_sizes]
        if any(h < 1 for h in hidden_sizes):
            raise ValueError(f"`hidden_sizes` must be positive widths; got {hidden_sizes}")
        if int(output_dim) < 1 or int(input_dim) < 1:
            raise ValueError(f"`input_dim` and `output_dim` must be >= 1; got {input_dim}, {output_dim}")
        if not prior_scale > 0:
            raise ValueError(f"`prior_scale` must be > 0; got {prior_scale!r}")
        widths = [int(input_dim)] + hidden_sizes + [int(output_dim)]
        n_layers = len(widths) - 1
        if not 0 <= point_layers <= n_layers:
            raise ValueError(f"`point_layers` must be between 0 and the {n_layers} layers; got {point_layers}")
        n_gaussian = n_layers - point_layers
        covariances = [covariance] * n_gaussian if isinstance(covariance, str) else list(covariance)
        if len(covariances) != n_gaussian:
            raise ValueError(f"`covariance` needs one entry per Gaussian layer ({n_gaussian}); got {covariances}")
        if n_gaussian and covariances[-1] not in ("diagonal", "full"):
            raise ValueError(f"the output layer's covariance must be 'diagonal' or 'full'; got {covariances[-1]!r}")
        _check_likelihood_outputs(likelihood, int(output_dim))
        self.activation = get_activation(activation)
        self.input_dim = int(input_dim)
        self.output_dim = int(output_dim)
        self.point_layers = int(point_layers)
        self.prior_scale = float(prior_scale)
        self.prior = prior
        self.likelihood = likelihood if likelihood is not None else NormalLikelihood()
        layers: List[nn.Module] = []
        for index, (inp, out) in enumerate(zip(widths[:-1], widths[1:])):
            if index < point_layers:
                layers.append(PointLinear(inp, out))
            else:
                bias = output_bias or index < n_layers - 1
                layers.append(
                    GaussianMatrix(
                        out,
                        inp + bias,
                        covariances[index - point_layers],
                        rank,
                        init_scale,
                        generator=generator,
                        bias=bias,
                    )
                )
        self.layers = nn.ModuleList(layers)
        # each estimator's objective on this network, decided once, when it is first asked for
        # (Estimator.bind: which fused node computes it), and again after a change of what it reads
        self.bound_objectives = {}

    # what the bound objectives' choice of fused nodes reads (bnn/fused/nodes.py)
    _STRUCTURE = frozenset({"activation", "likelihood", "prior", "layers", "point_layers", "output_dim"})

    def __setattr__(self, name, value):
        if name in self._STRUCTURE and "bound_objectives" in self.__dict__:
            self.bound_objectives.clear()
        super().__setattr__(name, value)

    # ------------------------------------------------------------------ structure

    @property
    def gaussian_layers(self) -> List[GaussianMatrix]:
        return [layer for layer in self.layers if isinstance(layer, GaussianMatrix)]

    def prior_scales(self) -> List[float]:
        """The prior standard deviation of each Gaussian layer (learned under empirical Bayes)."""
        return [
            float(layer.empirical_bayes_prior_scale().detach()) if self.prior == "empirical_bayes" else self.prior_scale
            for layer in self.gaussian_layers
        ]

    @property
    def precision(self) -> torch.Tensor:
        """The Normal likelihood's precision beta."""
        return self.likelihood.precision

    def layer_names(self) -> List[str]:
        """Names of the Gaussian layers for tables: ``first``, ``second``, ..., ``final``."""
        count = len(self.gaussian_layers)
        return [
            (_ORDINALS[i] if i < len(_ORDINALS) else f"layer {i + 1}") if i < count - 1 else "final"
            for i in range(count)
        ]

    def treatments(self, estimator: EstimatorLike = "analytic") -> Tuple[str, ...]:
        """Per layer: ``point``, ``sampled`` or ``closed_form`` under ``estimator``."""
        return make_estimator(estimator).treatments(self)

    def noise_shapes(self, batch: int, *, estimator: EstimatorLike = "analytic") -> Tuple[Tuple[int, ...], ...]:
        """Shapes of the standard-normal noise one evaluation consumes (one per sampled layer)."""
        return make_estimator(estimator).noise_shapes(self, batch)

    def sample_noise(
        self,
        batch: int,
        *,
        estimator: EstimatorLike = "analytic",
        generator=None,
        num_samples: Optional[int] = None,
        lead=(),
    ):
        """The noise one evaluation under ``estimator`` consumes (``()`` when nothing is sampled)."""
        return make_estimator(estimator).sample_noise(
            self, batch, generator=generator, num_samples=num_samples, lead=lead
        )

    def kl(self, *, folded: Optional[dict] = None) -> torch.Tensor:
        """``KL(q || p)`` of every Gaussian layer, in closed form; with ``prior="empirical_bayes"``
        each layer's prior variance is at its ELBO-optimal value given q. ``folded``: KL terms
        already computed, by layer index (:meth:`.Estimator.elbo`)."""
        prior_scale = None if self.prior == "empirical_bayes" else self.prior_scale
        folded = folded or {}
        terms = [
            folded[index] if index in folded else layer.kl(prior_scale)
            for index, layer in enumerate(self.layers)
            if isinstance(layer, GaussianMatrix)
        ]
        if not terms:  # every layer a point estimate
            first = self.layers[0].weight
            return torch.zeros((), dtype=first.dtype, device=first.device)
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

    # ------------------------------------------------------------------ outputs

    def checked_inputs(self, x, y=None):
        """``(x, y)`` as the network takes them (:mod:`.input_checks`): ``x`` ``(..., N,
        input_dim)`` of the parameters' dtype and device, ``y`` (if given) in the likelihood's
        shape (a one-output Normal's ``(N, 1)`` column squeezed to ``(N,)``); a ``ValueError``
        naming the argument otherwise."""
        check_inputs(self, x)
        if y is not None:
            check_targets = getattr(self.likelihood, "check_targets", None)  # a user's likelihood: as given
            if check_targets is not None:
                y = check_targets(y, x, self.output_dim)
        return x, y

    def point_features(self, x: torch.Tensor) -> torch.Tensor:
        """The activations after the point layers (``x`` itself when there are none; the
        outputs when every layer is a point layer)."""
        if not self.point_layers:  # (slicing a ModuleList builds a new module: not on the hot path)
            return x
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers[: self.point_layers]):
            x = layer(x) if index == last else self.activation(layer(x))  # no activation on the outputs
        return x

    def squeeze_outputs(self, *values):
        """Drop the output axis of one-output values (``(..., N, 1) -> (..., N)``)."""
        return tuple(v[..., 0] for v in values) if self.output_dim == 1 else values

    def output_moments(
        self,
        x,
        *,
        estimator: EstimatorLike = "analytic",
        noise=None,
        generator=None,
        after_point_layers: bool = False,
        split_variance: bool = False,
    ):
        """Mean and variance of the outputs under q, given the noise of the sampled layers.

        ``(mean, variance)``, or ``(mean, var_A, var_B)`` with ``split_variance`` (the
        paper's remark 2, eq. (44): the variance from the last hidden layer's weights and
        from the output layer's). Under ``sampling`` the output is the sample itself
        (variance 0). ``noise=None`` draws it from ``generator``; ``after_point_layers``
        says ``x`` is already :meth:`point_features`.
        """
        estimator = make_estimator(estimator)
        if not after_point_layers:
            check_inputs(self, x)
        h = x if after_point_layers else self.point_features(x)
        if noise is None:
            noise = estimator.sample_noise(self, h.shape[-2], generator=generator, lead=h.shape[:-2])
        mean, var_a, var_b = self.squeeze_outputs(*estimator.output_moments(self, h, noise))
        return (mean, var_a, var_b) if split_variance else (mean, var_a + var_b)

    @torch.no_grad()
    def output_mean(self, x):
        """The exact mean of the outputs ``y_hat`` under ``analytic`` (no variance; the
        deterministic prediction ``argmax y_hat``, eq. (42), needs nothing more).

        For a diagonal last hidden layer it takes a leaner path: the stacked means and variances
        of that layer (kept between calls inside :func:`~.layers.cached_weights`) in one batched
        product, and the mean-only moments of the activation. For the ReLU family that is the
        point layers' products, ``cfbnn::prediction_operand`` (the last point layer's activation,
        ``[h, 1]`` and ``[h^2, 1]`` in one pass), the batched product, ``cfbnn::prediction_hidden_mean``
        (``[E g, 1]`` from its means and variances in one pass) and the output layer's product
        (:mod:`cfbnn_cli.moments.predict_ops`).
        """
        treatments = ClosedForm().treatments(self)
        if "sampled" in treatments:
            raise ValueError(
                "output_mean() is the exact mean under 'analytic', which samples this network's first "
                f"{treatments.count('sampled')} Gaussian layer(s); use predict(x).mean (Monte Carlo over them) or "
                "predict(x, estimator='deterministic').mean (moments propagated)"
            )
        hidden_index = len(self.layers) - 2
        if (
            hidden_index < 0
            or treatments[hidden_index] != "closed_form"
            or self.layers[hidden_index].covariance != "diagonal"
            or "sampled" in treatments
        ):
            return self.output_moments(x, estimator=ClosedForm(), noise=())[0]
        check_inputs(self, x)
        hidden, output = self.layers[hidden_index], self.layers[-1]
        mean = self._operator_output_mean(x, hidden, output, family_of(self.activation))
        return mean[..., 0] if self.output_dim == 1 else mean

    def _operator_output_mean(self, x, hidden: GaussianMatrix, output: GaussianMatrix, family):
        """:meth:`output_mean` through the prediction operators: the products and two passes
        (``family``: :func:`~cfbnn_cli.moments.activations.family_of`)."""
        slope = family[1] if family else 0.0
        folded, inputs = NO_ACTIVATION, x  # folded: the activation the operand's pass applies
        if self.point_layers:
            for index in range(self.point_layers - 1):
                inputs = self.activation(self.layers[index](inputs))
            inputs = self.layers[self.point_layers - 1](inputs)
            if family is None:
                inputs = self.activation(inputs)
            else:
                folded = family[0]
        operand = torch.ops.cfbnn.prediction_operand(inputs, folded, slope, hidden.bias)
        moments = torch.bmm(operand, hidden.loc_and_variance().transpose(-1, -2))  # (gamma, xi^2): one product
        if family is not None:
            phi = torch.ops.cfbnn.prediction_hidden_mean(moments, family[0], slope, output.bias)
        else:
            gamma, variance = moments.unbind(0)
            phi = self.activation.mean(gamma, std_from_variance(variance))
            phi = augment(phi) if output.bias else phi
        return (phi @ output.loc.transpose(-1, -2)).reshape(*x.shape[:-1], self.output_dim)

    def sample_outputs(self, x, num_samples: int, *, generator=None, after_point_layers: bool = False):
        """``(S, ..., N[, O])`` outputs with every Gaussian layer sampled (local
        reparameterization), all samples in one batched computation."""
        sampling = LocalReparameterization()
        check_count(num_samples, "num_samples")
        if not after_point_layers:
            check_inputs(self, x)
        h = x if after_point_layers else self.point_features(x)
        noise = sampling.sample_noise(self, h.shape[-2], generator=generator, num_samples=num_samples)
        return self.output_moments(h, estimator=sampling, noise=noise, after_point_layers=True)[0]

    def predictive_components(
        self,
        x,
        *,
        estimator: EstimatorLike = "analytic",
        num_samples: int = 32,
        generator=None,
        chunk: int = 8,
        num_nodes: int = 64,
    ):
        """``p(y | x)`` as a mixture of Normals (:func:`~.predictive.predictive_components`)."""
        check_inputs(self, x)
        check_count(num_samples, "num_samples")
        check_count(chunk, "chunk")
        check_count(num_nodes, "num_nodes")
        return predictive_components(
            self,
            x,
            estimator=make_estimator(estimator),
            num_samples=num_samples,
            generator=generator,
            chunk=chunk,
            num_nodes=num_nodes,
        )

    def predict(self, x, *, estimator: EstimatorLike = "analytic", num_samples: int = 64, generator=None):
        """``p(y | x)``: for a one-output Normal likelihood a :class:`~cfbnn_cli.bnn.predictive.Predictive`
        (mean, variance and its parts, a Normal, intervals); for a categorical likelihood the
        class probabilities as a ``torch.distributions.Categorical``
        (:func:`~cfbnn_cli.bnn.predictive.class_distribution`: ``.probs``, ``.probs.argmax(-1)``)."""
        check_inputs(self, x)
        check_count(num_samples, "num_samples")
        if isinstance(self.likelihood, CategoricalLikelihood):
            return class_distribution(
                self, x, estimator=make_estimator(estimator), num_samples=num_samples, generator=generator
            )
        return predictive(self, x, estimator=make_estimator(estimator), num_samples=num_samples, generator=generator)

    # ------------------------------------------------------------------ objectives

    def expected_log_likelihood_per_point(
        self,
        x,
        y,
        *,
        estimator: EstimatorLike = "analytic",
        noise=None,
        generator=None,
        num_samples: int = 1,
        objective: Optional[str] = None,
    ):
        """``E_q[log p(y_n | x_n, W)]`` per data point ``(..., N)`` (summed over outputs):
        exact, or a one-sample estimate over the sampled layers
        (:meth:`.Estimator.expected_log_likelihood_per_point`)."""
        x, y = self.checked_inputs(x, y)
        check_count(num_samples, "num_samples")
        return (
            make_estimator(estimator)
            .bind(self)
            .ell(x, y, noise=noise, generator=generator, num_samples=num_samples, objective=objective)
        )

    def expected_log_likelihood(self, x, y, **options):
        """The summed ``E_q[sum_n log p(y_n | x_n, W)]`` (eq. (7) for the Normal likelihood); the
        options (by keyword) of :meth:`expected_log_likelihood_per_point`."""
        return self.expected_log_likelihood_per_point(x, y, **options).sum(-1)

    def elbo(
        self,
        x,
        y,
        *,
        num_data: Optional[int] = None,
        estimator: EstimatorLike = "analytic",
        noise=None,
        generator=None,
        num_samples: int = 1,
        objective: Optional[str] = None,
    ):
        """``(num_data / batch) ELL - KL`` (eq. (4)): an unbiased minibatch ELBO
        (:meth:`.Estimator.bind`: the estimator's objective on this network). ``num_data`` is the number of rows of the whole data set;
        ``None`` means ``x`` *is* the whole data set, so a minibatch given without it is the ELBO of
        those rows alone, its likelihood under-weighted against the KL by ``batch / N``."""
        x, y = self.checked_inputs(x, y)
        num_data = check_num_data(num_data, x.shape[-2])
        check_count(num_samples, "num_samples")
        return (
            make_estimator(estimator)
            .bind(self)
            .elbo(
                x, y, num_data=num_data, noise=noise, generator=generator, num_samples=num_samples, objective=objective
            )
        )

    def forward(
        self,
        x,
        y=None,
        *,
        estimator: EstimatorLike = "analytic",
        noise=None,
        generator=None,
        num_samples: Optional[int] = None,
        objective: Optional[str] = None,
    ):
        """``model(x)``: the predictive distribution (:meth:`predict`; ``num_samples`` its draws of
        the sampled layers, 64 if not given). ``model(x, y, ...)``: the summed expected
        log-likelihood (what ``torch.func.functional_call`` and ``DistributedDataParallel``
        evaluate in training; ``num_samples`` the objective's samples, 1 if not given)."""
        if y is None:
            if noise is not None or objective is not None:
                raise ValueError("model(x) predicts: `noise` and `objective` are for model(x, y)")
            draws = {} if num_samples is None else {"num_samples": num_samples}
            return self.predict(x, estimator=estimator, generator=generator, **draws)
        return self.expected_log_likelihood(
            x,
            y,
            estimator=estimator,
            noise=noise,
            generator=generator,
            num_samples=1 if num_samples is None else num_samples,
            objective=objective,
        )


class ClosedFormBNN(BayesianNetwork):
    """The paper's network ``x -> A x -> g(A x) -> B g(A x)``, both matrices integrated out.

    ``input_dim`` excludes the bias column (added here). ``likelihood``: a likelihood object
    (:class:`~cfbnn_cli.bnn.likelihoods.NormalLikelihood`, the exact ELBO, or
    :class:`~cfbnn_cli.bnn.likelihoods.CategoricalLikelihood`, whose objective -- see
    :data:`~cfbnn_cli.bnn.likelihoods.CLASSIFICATION_OBJECTIVES` -- is also selectable per
    call), as everywhere in the library; its name (``"normal"``, ``"softmax"``,
    ``"logistic"``, with ``precision``, ``learn_precision`` and ``objective``) is the
    shorthand a config passes.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int,
        output_dim: int = 1,
        activation="relu",
        a_covariance: str = "diagonal",
        b_covariance: str = "diagonal",
        rank: int = 10,
        prior_scale: float = 1.0,
        likelihood="normal",
        precision: float = 1.0,
        learn_precision: bool = True,
        init_scale: float = 1e-2,
        generator: Optional[torch.Generator] = None,
        output_bias: bool = True,
        objective: str = "approximation",
    ):
        if isinstance(likelihood, str):
            if likelihood not in LIKELIHOODS:
                raise ValueError(
                    f"`likelihood` must be one of {LIKELIHOODS} or a likelihood object; got {likelihood!r}"
                )
            likelihood = make_likelihood(likelihood, precision, learn_precision, objective)
        elif not isinstance(likelihood, (NormalLikelihood, CategoricalLikelihood, HeteroscedasticNormalLikelihood)):
            raise ValueError(
                "`likelihood` must be a NormalLikelihood, HeteroscedasticNormalLikelihood or CategoricalLikelihood "
                f"(or its name); got {likelihood!r}"
            )
        if b_covariance not in ("diagonal", "full"):
            raise ValueError(f"`b_covariance` must be 'diagonal' or 'full'; got {b_covariance!r}")
        super().__init__(
            input_dim,
            [hidden_dim],
            output_dim,
            activation,
            [a_covariance, b_covariance],
            rank,
            prior_scale,
            init_scale,
            likelihood,
            output_bias=output_bias,
            generator=generator,
        )

    @property
    def a(self) -> GaussianMatrix:
        return self.layers[0]

    @property
    def b(self) -> GaussianMatrix:
        return self.layers[1]

    def predictive(self, x):
        """``(mean, var_from_A, var_from_B, observation_noise)`` at ``x``, no sampling (eq. (44));
        the noise ``1/beta`` is ``None`` for a categorical likelihood (its logits have none)."""
        mean, var_a, var_b = self.output_moments(x, estimator=ClosedForm(), noise=(), split_variance=True)
        noise = 1.0 / self.precision if isinstance(self.likelihood, NormalLikelihood) else None
        return mean, var_a, var_b, noise


def bayesian_head(
    feature_dim: int,
    hidden_sizes: Sequence[int],
    num_classes: int,
    activation="relu",
    prior_scale: float = 1.0,
    init_scale: float = 1e-2,
    generator: Optional[torch.Generator] = None,
    objective: str = "approximation",
) -> BayesianNetwork:
    """The Figure 1 head on frozen features (paper "Fast Prediction"):
    ``features -> Linear (point estimate) -> g -> [Gaussian] -> g -> [Gaussian] -> logits``.

    Under ``analytic`` the logits' mean and variance are exact given the point layer's
    activations (nothing sampled); ``argmax`` of :meth:`BayesianNetwork.output_mean` is the
    deterministic prediction, eq. (42).
    """
    from .likelihoods import CategoricalLikelihood

    hidden_sizes = list(hidden_sizes)
    if len(hidden_sizes) != 2 or any(int(h) < 1 for h in hidden_sizes):
        raise ValueError(
            f"`hidden_sizes` must be two positive widths [point layer, Bayesian hidden layer]; got {hidden_sizes}"
        )
    if int(num_classes) < 2:
        raise ValueError(f"`num_classes` must be >= 2; got {num_classes}")
    return BayesianNetwork(
        feature_dim,
        hidden_sizes,
        num_classes,
        activation,
        "diagonal",
        prior_scale=prior_scale,
        init_scale=init_scale,
        likelihood=CategoricalLikelihood(objective),
        point_layers=1,
        generator=generator,
    )
