"""A Hydra callback that runs ``cfbnn report`` on the sweep dir when a multirun ends.

Enabled in every command's config (``hydra.callbacks.report``); turn it off with
``~hydra.callbacks.report``. A failing report never fails the sweep: it is logged.
"""

from __future__ import annotations

import logging

from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)


class ReportOnMultirunEnd(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        from .aggregate import report

        sweep_dir = config.hydra.sweep.dir
        try:
            report(sweep_dir)
        except Exception as error:  # the jobs' results are safe on disk; say why the summary is missing
            log.warning("cfbnn report on %s failed: %s (run `cfbnn report %s` to retry)", sweep_dir, error, sweep_dir)
