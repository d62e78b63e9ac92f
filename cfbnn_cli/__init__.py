"""cfbnn: closed-form variational objectives for Bayesian neural networks.

Floors (arrows point down only): ``cli`` -> ``pipelines`` -> ``bnn`` -> ``moments``;
beside them ``data``, ``report`` and ``runtime``. See the repository's README.
"""

__version__ = "0.1.0"
