"""Pyro integration: the same network as a Pyro model + guide, and a closed-form loss.

* :class:`BNNRegressionModel` (``PyroModule``): priors ``A ~ N(0, s^2)``,
  ``B ~ N(0, s^2)``, likelihood ``y ~ N(B g(A [x, 1]), 1/beta)``.
* :class:`BNNRegressionGuide` (``PyroModule``): ``q(a_h) = MVN(a_loc_h, L_h L_h^T)``
  (independent rows), ``q(B) = MVN(b_loc, L_B L_B^T)``.
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
former averages to the latter (tests/test_pyro_glue.py).
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import ELBO
from pyro.nn import PyroModule, PyroParam, PyroSample
from torch.distributions import constraints

from ..moments import get_activation
from .functional import augment, kl_normal_rows, regression_expected_log_likelihood


class BNNRegressionModel(PyroModule):
    def __init__(
        self, input_dim: int, hidden_dim: int, activation="relu", prior_scale: float = 1.0, precision: float = 1.0
    ):
        super().__init__()
        self.input_dim = input_dim
        self.hidden_dim = hidden_dim
        self.activation = get_activation(activation)
        self.prior_scale = float(prior_scale)
        self.precision = float(precision)

    def forward(self, x, y=None):
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
        with pyro.plate("data", x.shape[0], dim=-1):
            pyro.sample("y", dist.Normal(f, self.precision**-0.5), obs=y)
        return f


class BNNRegressionGuide(PyroModule):
    def __init__(self, input_dim: int, hidden_dim: int, init_scale: float = 0.1, generator=None):
        super().__init__()
        D, H = input_dim + 1, hidden_dim
        self.a_loc = PyroParam(torch.randn(H, D, generator=generator) / D**0.5)
        self.a_scale_tril = PyroParam(
            init_scale * torch.eye(D).expand(H, D, D).clone(), constraint=constraints.lower_cholesky
        )
        self.b_loc = PyroParam(torch.randn(H, generator=generator) / H**0.5)
        self.b_scale_tril = PyroParam(init_scale * torch.eye(H), constraint=constraints.lower_cholesky)

    def forward(self, x, y=None):
        pyro.sample("A", dist.MultivariateNormal(self.a_loc, scale_tril=self.a_scale_tril).to_event(1))
        pyro.sample("B", dist.MultivariateNormal(self.b_loc, scale_tril=self.b_scale_tril))


def _mvn_parts(fn):
    while isinstance(fn, dist.Independent):
        fn = fn.base_dist
    if not isinstance(fn, torch.distributions.MultivariateNormal):
        raise ValueError(f"ClosedFormELBO needs MultivariateNormal guide sites for A and B; got {type(fn).__name__}")
    return fn.loc, fn.scale_tril


def _normal_scale(fn):
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution)):
        fn = fn.base_dist
    if not isinstance(fn, torch.distributions.Normal):
        raise ValueError(f"ClosedFormELBO needs Normal priors and likelihood; got {type(fn).__name__}")
    return fn.scale


class ClosedFormELBO(ELBO):
    """The exact negative ELBO of the one-hidden-layer regression BNN, as a Pyro loss.

    Reads ``q(A)``, ``q(B)`` from the guide's sample sites ``"A"`` and ``"B"``, the
    prior scale and the likelihood precision from the model's sites, the inputs from
    the first argument and the observations from site ``"y"``; the activation from
    ``model.activation``. A plate scale on ``"y"`` (subsampling) multiplies the ELL.
    """

    def __init__(self):
        super().__init__(num_particles=1, max_plate_nesting=1)

    def differentiable_loss(self, model, guide, *args, **kwargs):
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
        a_loc, a_scale_tril = _mvn_parts(guide_trace.nodes["A"]["fn"])
        b_loc, b_scale_tril = _mvn_parts(guide_trace.nodes["B"]["fn"])
        prior_a = _normal_scale(model_trace.nodes["A"]["fn"])
        prior_b = _normal_scale(model_trace.nodes["B"]["fn"])
        obs = model_trace.nodes["y"]
        precision = _normal_scale(obs["fn"]).reshape(-1)[0] ** -2
        x = args[0]
        ell = regression_expected_log_likelihood(
            augment(x), obs["value"], a_loc, a_scale_tril, b_loc, b_scale_tril, precision, model.activation
        )
        kl = kl_normal_rows(a_loc, a_scale_tril, prior_a.reshape(-1)[0]) + kl_normal_rows(
            b_loc.unsqueeze(0), b_scale_tril.unsqueeze(0), prior_b.reshape(-1)[0]
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
