"""Pyro integration: the same network as a Pyro model + guide, and a closed-form loss.

* :class:`BNNRegressionModel` (``PyroModule``): priors ``A ~ N(0, s^2)``,
  ``B ~ N(0, s^2)``, likelihood ``y ~ N(B g(A [x, 1]), 1/beta)`` with the noise
  precision ``beta`` learned (a Pyro parameter) unless fixed.
* :class:`BNNRegressionGuide` (``PyroModule``): ``q(A) q(B)`` with independent rows, each
  row Normal with a diagonal covariance (mean field, as :class:`~cfbnn_cli.bnn.ClosedFormBNN`)
  or a full one (``a_covariance`` / ``b_covariance``).
* :class:`PyroMLPRegression`: Pyro's standard ``nn.Linear`` + ``PyroSample`` BNN (the peer
  in benchmarks and the UCI protocol).
* :class:`PyroLocalReparameterizationRegression`: the same network as a Pyro model + guide
  pair trained by local reparameterization (the ``pyro.contrib.bnn`` / TyXe recipe), the
  UCI protocol's strongest Pyro peer.
* :class:`ClosedFormELBO`: a drop-in for ``pyro.infer.Trace_ELBO`` with the ELBO
  interface (``loss``, ``differentiable_loss``, ``loss_and_grads``) that computes
  ``-(ELL - KL)`` exactly from the guide's distribution parameters -- no sampling.

``SVI(model, guide, optim, Trace_ELBO())`` and ``SVI(model, guide, optim,
ClosedFormELBO())`` optimize the same parameters; the Monte Carlo loss of the
former averages to the latter (tests/bnn/test_pyro_glue.py).
"""

from __future__ import annotations

import inspect

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import ELBO
from pyro.nn import PyroModule, PyroParam, PyroSample
from pyro.nn.module import pyro_method
from torch.distributions import constraints

from ..moments import get_activation
from .functional import augment, kl_normal_rows, regression_expected_log_likelihood

COVARIANCES = ("diagonal", "full")


class BNNRegressionModel(PyroModule):
    """The paper's regression network ``y = B g(A [x, 1]) + noise`` as a Pyro model.

    Sites: ``"A"`` ``(H, D + 1)`` and ``"B"`` ``(H,)`` with ``N(0, prior_scale^2)``
    priors on every entry, and ``"y"`` ``~ N(f(x), 1/beta)`` under the plate ``"data"``.
    ``forward(x, y=None, num_data=None)``: ``x`` ``(N, input_dim)``; ``num_data``, when
    ``x`` is a minibatch of a larger data set, scales the likelihood by ``num_data / N``.

    The noise precision ``beta`` is learned by default: a Pyro parameter ``precision``
    (positive, starting at ``precision``) that SVI optimizes with the guide, i.e. the
    ELBO is maximized over ``beta`` -- type-II maximum likelihood, as
    :class:`~cfbnn_cli.bnn.ClosedFormBNN` learns it and as the paper's ELL (eq. (7))
    allows, since it is exact in ``beta``. A fixed ``beta`` is wrong by the data's noise
    level in whatever units ``y`` has: too large, and the fit chases noise while the
    predictive intervals are far too narrow. ``learn_precision=False`` keeps it at
    ``precision`` (for a known noise level). A point estimate rather than a prior on
    ``beta`` keeps the model the one the library's networks fit and ``ClosedFormELBO``
    exact; with hundreds of observations and one noise parameter, the posterior of
    ``beta`` is narrow anyway.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int,
        activation="relu",
        prior_scale: float = 1.0,
        precision: float = 1.0,
        learn_precision: bool = True,
    ):
        super().__init__()
        if not float(precision) > 0:
            raise ValueError(f"`precision` (the noise precision beta) must be > 0; got {precision!r}")
        self.input_dim = input_dim
        self.hidden_dim = hidden_dim
        self.activation = get_activation(activation)
        self.prior_scale = float(prior_scale)
        self.learn_precision = bool(learn_precision)
        if self.learn_precision:
            self.precision = PyroParam(torch.tensor(float(precision)), constraint=constraints.positive)
        else:
            self.precision = float(precision)

    @pyro_method
    def noise_precision(self) -> torch.Tensor:
        """``beta`` as a tensor: the learned Pyro parameter (registered with the
        param store, so SVI steps it) or the fixed value."""
        precision = self.precision
        return precision if isinstance(precision, torch.Tensor) else torch.tensor(precision)

    def forward(self, x, y=None, num_data=None):
        xa = augment(x)
        H, D = self.hidden_dim, self.input_dim + 1
        A = pyro.sample("A", dist.Normal(xa.new_zeros(()), self.prior_scale).expand([H, D]).to_event(2))
        B = pyro.sample("B", dist.Normal(xa.new_zeros(()), self.prior_scale).expand([H]).to_event(1))
        hidden = self.activation(xa @ A.transpose(-1, -2))  # (..., N, H)
        f = (hidden * B.unsqueeze(-2)).sum(-1)
        if A.dim() > 2:
            # vectorized particles put A's batch dims (..., 1) left of the data plate
            # (dim -1); drop that singleton so f is (..., N) under the plate.
            f = f.squeeze(-2)
        if num_data is None:
            plate = pyro.plate("data", x.shape[0], dim=-1)
        else:  # an explicit subsample: the caller drew the minibatch; the plate scales by num_data / rows
            plate = pyro.plate("data", int(num_data), subsample=torch.arange(x.shape[0], device=x.device), dim=-1)
        with plate:
            pyro.sample("y", dist.Normal(f, self.precision**-0.5), obs=y)
        return f


class BNNRegressionGuide(PyroModule):
    """``q(A) q(B)`` for :class:`BNNRegressionModel`: every row of ``A`` and ``B`` Normal.

    ``a_covariance`` / ``b_covariance`` choose each matrix's covariance, as in
    :class:`~cfbnn_cli.bnn.ClosedFormBNN`:

    * ``"diagonal"`` (default, mean field): parameters ``a_loc`` ``(H, D + 1)`` and
      ``a_scale`` ``(H, D + 1)`` standard deviations; ``b_loc``, ``b_scale`` ``(H,)``.
      ``O(H D)`` parameters and the cheapest closed form.
    * ``"full"``: ``a_scale`` ``(H, D + 1, D + 1)`` is the Cholesky factor of each
      row's covariance (rows independent of each other); ``b_scale`` ``(H, H)``. The
      closed form stays exact (the hidden units are uncorrelated given ``x``), at
      ``O(N H D^2)`` per step.

    Scales start at ``init_scale``, means at ``N(0, 1/fan_in)`` draws from ``generator``.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int,
        a_covariance: str = "diagonal",
        b_covariance: str = "diagonal",
        init_scale: float = 0.1,
        generator=None,
    ):
        super().__init__()
        for name, value in (("a_covariance", a_covariance), ("b_covariance", b_covariance)):
            if value not in COVARIANCES:
                raise ValueError(f"`{name}` must be one of {COVARIANCES}; got {value!r}")
        D, H = input_dim + 1, hidden_dim
        self.a_covariance, self.b_covariance = a_covariance, b_covariance
        self.a_loc = PyroParam(torch.randn(H, D, generator=generator) / D**0.5)
        self.a_scale = _scale_param((H, D), a_covariance, init_scale)
        self.b_loc = PyroParam(torch.randn(H, generator=generator) / H**0.5)
        self.b_scale = _scale_param((H,), b_covariance, init_scale)

    @pyro_method
    def variational_parameters(self):
        """``(a_loc, a_scale, b_loc, b_scale)`` in :mod:`cfbnn_cli.bnn.functional`'s
        convention (a scale is standard deviations or a Cholesky factor), read through
        the param store, so SVI steps them."""
        return self.a_loc, self.a_scale, self.b_loc, self.b_scale

    def forward(self, x, y=None, num_data=None):
        a_loc, a_scale, b_loc, b_scale = self.variational_parameters()
        if self.a_covariance == "diagonal":
            pyro.sample("A", dist.Normal(a_loc, a_scale).to_event(2))
        else:
            pyro.sample("A", dist.MultivariateNormal(a_loc, scale_tril=a_scale).to_event(1))
        if self.b_covariance == "diagonal":
            pyro.sample("B", dist.Normal(b_loc, b_scale).to_event(1))
        else:
            pyro.sample("B", dist.MultivariateNormal(b_loc, scale_tril=b_scale))


def _scale_param(shape, covariance: str, init_scale: float) -> PyroParam:
    if covariance == "diagonal":
        return PyroParam(torch.full(shape, float(init_scale)), constraint=constraints.positive)
    size = shape[-1]
    return PyroParam(
        float(init_scale) * torch.eye(size).expand(*shape, size).clone(), constraint=constraints.lower_cholesky
    )


def _guide_parts(fn, site: str):
    """``(loc, scale)`` of a guide site: a Normal gives standard deviations shaped as its
    loc, a MultivariateNormal its Cholesky factor."""
    while isinstance(fn, dist.Independent):
        fn = fn.base_dist
    if isinstance(fn, torch.distributions.MultivariateNormal):
        return fn.loc, fn.scale_tril
    if isinstance(fn, torch.distributions.Normal):
        return torch.broadcast_tensors(fn.loc, fn.scale)
    raise ValueError(
        f"ClosedFormELBO needs a Normal or MultivariateNormal guide site {site!r}; got {type(fn).__name__}"
    )


def _normal_scale(fn):
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution)):
        fn = fn.base_dist
    if not isinstance(fn, torch.distributions.Normal):
        raise ValueError(f"ClosedFormELBO needs Normal priors and likelihood; got {type(fn).__name__}")
    return fn.scale


_MODEL_ARGUMENTS = inspect.signature(BNNRegressionModel.forward)


class ClosedFormELBO(ELBO):
    """The exact negative ELBO of the one-hidden-layer regression BNN, as a Pyro loss.

    A genuine :class:`pyro.infer.ELBO`: ``SVI(model, guide, optim, ClosedFormELBO())``
    steps the same Pyro parameters as ``Trace_ELBO`` would (the guide's and the model's
    learned precision), and the value is the expectation of ``Trace_ELBO``'s estimate.

    * With :class:`BNNRegressionModel` and :class:`BNNRegressionGuide` (not subclasses
      that override ``forward``) the loss is computed straight from the guide's
      parameters and the model's precision (:func:`~cfbnn_cli.bnn.functional.regression_expected_log_likelihood`
      and :func:`~cfbnn_cli.bnn.functional.kl_normal_rows`): no trace, no weight draws,
      no distribution objects. Arguments as the model takes them: ``(x, y, num_data=None)``.
    * Any other guide whose sites ``"A"`` and ``"B"`` are Normal or MultivariateNormal
      (a guide function with its own ``pyro.param`` calls; not an autoguide, whose sites are
      Delta distributions of transformed draws) is traced once with the model:
      ``q(A)``, ``q(B)`` come from the guide's sites, the prior scale and the precision
      from the model's, the inputs from the first argument, the observations from site
      ``"y"`` and the activation from ``model.activation``. A plate scale on ``"y"``
      (subsampling) multiplies the ELL.
    """

    def __init__(self):
        super().__init__(num_particles=1, max_plate_nesting=1)

    def differentiable_loss(self, model, guide, *args, **kwargs):
        if _plain(model, BNNRegressionModel) and _plain(guide, BNNRegressionGuide):
            return self._direct_loss(model, guide, *args, **kwargs)
        return self._traced_loss(model, guide, *args, **kwargs)

    @staticmethod
    def _direct_loss(model, guide, *args, **kwargs):
        bound = _MODEL_ARGUMENTS.bind(model, *args, **kwargs).arguments
        x, y, num_data = bound["x"], bound.get("y"), bound.get("num_data")
        if y is None:
            raise ValueError("ClosedFormELBO needs the observations: call svi.step(x, y)")
        a_loc, a_scale, b_loc, b_scale = guide.variational_parameters()
        precision = model.noise_precision()
        ell = regression_expected_log_likelihood(
            augment(x), y, a_loc, a_scale, b_loc, b_scale, precision, model.activation
        )
        if num_data is not None:
            ell = ell * (int(num_data) / x.shape[0])
        kl = kl_normal_rows(a_loc, a_scale, model.prior_scale) + kl_normal_rows(
            b_loc.unsqueeze(0), b_scale.unsqueeze(0), model.prior_scale
        )
        return kl - ell

    @staticmethod
    def _traced_loss(model, guide, *args, **kwargs):
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
        a_loc, a_scale = _guide_parts(guide_trace.nodes["A"]["fn"], "A")
        b_loc, b_scale = _guide_parts(guide_trace.nodes["B"]["fn"], "B")
        prior_a = _normal_scale(model_trace.nodes["A"]["fn"])
        prior_b = _normal_scale(model_trace.nodes["B"]["fn"])
        obs = model_trace.nodes["y"]
        precision = _normal_scale(obs["fn"]).reshape(-1)[0] ** -2
        x = args[0]
        ell = regression_expected_log_likelihood(
            augment(x), obs["value"], a_loc, a_scale, b_loc, b_scale, precision, model.activation
        )
        kl = kl_normal_rows(a_loc, a_scale, prior_a.reshape(-1)[0]) + kl_normal_rows(
            b_loc.unsqueeze(0), b_scale.unsqueeze(0), prior_b.reshape(-1)[0]
        )
        return -(obs["scale"] * ell - kl)

    def _get_trace(self, model, guide, args, kwargs):  # pragma: no cover - nothing is sampled
        raise NotImplementedError("ClosedFormELBO computes the ELBO exactly and draws no traces")

    def loss(self, model, guide, *args, **kwargs):
        with torch.no_grad():
            return self.differentiable_loss(model, guide, *args, **kwargs).item()

    def loss_and_grads(self, model, guide, *args, **kwargs):
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        loss.backward()
        return loss.item()


def _plain(module, cls) -> bool:
    """``module`` is a ``cls`` whose ``forward`` is ``cls``'s own, so its sites are the ones
    the direct closed form assumes."""
    return isinstance(module, cls) and type(module).forward is cls.forward


class PyroMLPRegression(PyroModule):
    """Pyro's standard BNN recipe, as a peer to compare against (not used by cfbnn's objectives).

    ``nn.Linear`` layers ``D -> H -> 1`` whose weights and biases are ``PyroSample``
    sites with ``N(0, prior_scale^2)`` priors, an activation in between, and a
    Normal likelihood whose scale ``noise_scale`` is a learned ``PyroParam``
    (type-II maximum likelihood, as cfbnn learns its precision). Pair it with
    ``AutoNormal`` and ``Trace_ELBO`` (weight-space sampling) and predict with
    ``pyro.infer.Predictive``. ``num_data`` scales a minibatch's likelihood.
    """

    def __init__(self, input_dim: int, hidden_dim: int, activation="relu", prior_scale: float = 1.0, device=None):
        super().__init__()
        zero = torch.zeros((), device=device)
        prior = dist.Normal(zero, zero + prior_scale)
        self.activation = get_activation(activation)
        self.fc1 = PyroModule[torch.nn.Linear](input_dim, hidden_dim)
        self.fc1.weight = PyroSample(prior.expand([hidden_dim, input_dim]).to_event(2))
        self.fc1.bias = PyroSample(prior.expand([hidden_dim]).to_event(1))
        self.fc2 = PyroModule[torch.nn.Linear](hidden_dim, 1)
        self.fc2.weight = PyroSample(prior.expand([1, hidden_dim]).to_event(2))
        self.fc2.bias = PyroSample(prior.expand([1]).to_event(1))
        self.noise_scale = PyroParam(torch.ones((), device=device), constraint=constraints.positive)
        self.to(device)

    def forward(self, x, y=None, num_data=None):
        f = self.fc2(self.activation(self.fc1(x))).squeeze(-1)
        size = x.shape[0] if num_data is None else int(num_data)
        # an explicit subsample: the caller already drew the minibatch; the plate scales by size/batch
        with pyro.plate("data", size, subsample=torch.arange(x.shape[0], device=x.device)):
            pyro.sample("y", dist.Normal(f, self.noise_scale), obs=y)
        return f


class PyroLocalReparameterizationRegression(PyroModule):
    """Pyro's local-reparameterization BNN: ``model`` and ``guide`` for ``TraceMeanField_ELBO``.

    The network, priors and learned noise are :class:`PyroMLPRegression`'s; the guide is
    mean-field Normal over every weight and bias (``loc`` and ``scale`` are Pyro parameters).
    The model declares each weight site with its prior, so ``TraceMeanField_ELBO`` takes
    their KL analytically, but computes the likelihood's mean from the guide's ``loc`` and
    ``scale`` by local reparameterization (Kingma et al. 2015): each hidden pre-activation
    is drawn per data point from ``N(x loc^T, x^2 (scale^2)^T)`` and the output from the
    same rule, which is what ``pyro.contrib.bnn.HiddenLayer`` and TyXe's
    ``local_reparameterization`` do. (``HiddenLayer`` itself fails inside ``pyro.plate``
    and under ``Predictive`` with pyro 1.9, so it is written out here.) Under
    ``Predictive(model, guide=guide)`` every point gets its own draws, the right per-point
    predictive marginal. ``start`` gives the guide's starting means by site name.
    """

    SITES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int,
        activation="relu",
        prior_scale: float = 1.0,
        init_scale: float = 0.01,
        start=None,
        device=None,
    ):
        super().__init__()
        self.activation = get_activation(activation)
        self.prior_scale = float(prior_scale)
        shapes = {
            "fc1.weight": (hidden_dim, input_dim),
            "fc1.bias": (hidden_dim,),
            "fc2.weight": (1, hidden_dim),
            "fc2.bias": (1,),
        }
        self.shapes = shapes
        start = start or {}
        for name, shape in shapes.items():
            loc = start.get(name, torch.zeros(shape)).detach().to(device=device, dtype=torch.float32).clone()
            setattr(self, _param_name(name, "loc"), PyroParam(loc))
            setattr(
                self,
                _param_name(name, "scale"),
                PyroParam(torch.full(shape, float(init_scale), device=device), constraint=constraints.positive),
            )
        self.noise_scale = PyroParam(torch.ones((), device=device), constraint=constraints.positive)

    def _loc_scale(self, name):
        return getattr(self, _param_name(name, "loc")), getattr(self, _param_name(name, "scale"))

    def _layer(self, x, layer):
        """One linear layer's output, drawn per row by local reparameterization."""
        weight_loc, weight_scale = self._loc_scale(f"{layer}.weight")
        bias_loc, bias_scale = self._loc_scale(f"{layer}.bias")
        mean = x @ weight_loc.T + bias_loc
        variance = x.square() @ weight_scale.square().T + bias_scale.square()
        return mean + variance.sqrt() * torch.randn_like(mean)

    def model(self, x, y=None, num_data=None):
        zero = x.new_zeros(())
        for name, shape in self.shapes.items():
            pyro.sample(name, dist.Normal(zero, zero + self.prior_scale).expand(shape).to_event(len(shape)))
        f = self._layer(self.activation(self._layer(x, "fc1")), "fc2").squeeze(-1)
        size = x.shape[0] if num_data is None else int(num_data)
        with pyro.plate("data", size, subsample=torch.arange(x.shape[0], device=x.device)):
            pyro.sample("y", dist.Normal(f, self.noise_scale), obs=y)
        return f

    def guide(self, x, y=None, num_data=None):
        for name in self.shapes:
            loc, scale = self._loc_scale(name)
            pyro.sample(name, dist.Normal(loc, scale).to_event(loc.dim()))


def _param_name(site: str, part: str) -> str:
    return f"{site.replace('.', '_')}_{part}"
