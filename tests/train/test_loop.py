"""train/loop.py: the one training loop (epochs or a step schedule, best and last checkpoints,
metrics.csv, resume with the config fingerprint, the NaN guard), on a toy regression."""

import math

import pandas as pd
import pytest
import torch

from cfbnn_cli.runtime.errors import ConfigError
from cfbnn_cli.runtime.numerics import NonFiniteLossError
from cfbnn_cli.train import TrainingLoop


def _toy(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(64, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    return x, y, model


def _loop(model, x, y, tmp_path, scores=None, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss(rows):
        return (model(x[rows]).squeeze(-1) - y[rows]).square().mean()

    evaluate = (lambda epoch: {"score": scores[epoch - 1]}) if scores is not None else None
    options = dict(
        epochs=5,
        data_generator=torch.Generator().manual_seed(1),
        checkpoint_dir=tmp_path / "checkpoints",
        metrics_path=tmp_path / "metrics.csv",
        evaluate=evaluate,
        fingerprint="abc",
    )
    options.update(kwargs)
    return TrainingLoop(model, optimizer, loss, len(y), 16, torch.device("cpu"), **options)


def test_epochs_write_metrics_and_the_best_epoch_is_the_one_loaded(tmp_path):
    x, y, model = _toy()
    scores = [0.1, 0.7, 0.3, 0.2, 0.5]  # epoch 2 is the best
    loop = _loop(model, x, y, tmp_path, scores, select=("score", "max"))
    result = loop.run()
    history = pd.read_csv(tmp_path / "metrics.csv")
    assert list(history["epoch"]) == [1, 2, 3, 4, 5] and list(history["score"]) == scores
    assert history["train_elbo_per_point"].iloc[-1] > history["train_elbo_per_point"].iloc[0]  # -loss rises
    assert result.best == {"epoch": 2, "value": 0.7}
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)
    assert best["epoch"] == 2
    last_weight = model.weight.detach().clone()
    assert loop.load_best()
    torch.testing.assert_close(model.weight.detach(), best["model"]["weight"])
    assert not torch.equal(model.weight.detach(), last_weight)


def test_a_fixed_schedule_runs_exactly_its_steps_on_an_outer_bar(tmp_path):
    class Bar:  # the outer bar of the UCI protocol, shared by every (split, method)
        n = 0

        def update(self, steps):
            self.n += steps

    x, y, model = _toy()
    schedule = torch.randint(0, 64, (7, 16), generator=torch.Generator().manual_seed(2))
    bar = Bar()
    result = _loop(model, x, y, tmp_path, schedule=schedule, checkpoint_dir=None, metrics_path=None, progress=bar).run()
    assert bar.n == 7
    assert result.steps == 7 and len(result.history) == 1
    assert not (tmp_path / "checkpoints").exists()


def test_resume_continues_exactly_and_refuses_another_configuration(tmp_path):
    x, y, model = _toy()
    scores = [0.1, 0.2, 0.3, 0.4, 0.5]
    whole = _loop(model, x, y, tmp_path / "whole", scores, select=("score", "max"))
    whole.run()

    x, y, model = _toy()
    stopped = _loop(model, x, y, tmp_path / "run", scores, select=("score", "max"), epochs=2)  # as if killed after 2
    stopped.run()
    x, y, _ = _toy()
    model = _toy(seed=7)[2]  # another start: everything must come from the checkpoint
    resumed = _loop(model, x, y, tmp_path / "run", scores, select=("score", "max"), resume=True)
    assert resumed.restore() == 2
    resumed.run()
    a = pd.read_csv(tmp_path / "whole" / "metrics.csv").drop(columns="epoch_seconds")
    b = pd.read_csv(tmp_path / "run" / "metrics.csv").drop(columns="epoch_seconds")
    pd.testing.assert_frame_equal(a, b)
    torch.testing.assert_close(model.weight.detach(), whole.model.weight.detach(), rtol=0, atol=0)

    x, y, model = _toy()
    foreign = _loop(model, x, y, tmp_path / "run", scores, resume=True, fingerprint="another")
    with pytest.raises(ConfigError, match="written by another configuration"):
        foreign.restore()


def test_a_nan_loss_stops_with_the_epoch_and_step_and_keeps_the_last_checkpoint(tmp_path):
    x, y, model = _toy()
    y = y.clone()
    y[40:] = math.nan  # every batch with one of those rows is NaN; the permutation puts one in epoch 1
    loop = _loop(model, x, y, tmp_path)
    with pytest.raises(NonFiniteLossError, match=r"train loss became nan at epoch 1, step \d"):
        loop.run()
    assert not (tmp_path / "checkpoints" / "last.pt").exists()  # nothing written from a NaN epoch


def test_patience_stops_after_the_best_and_the_in_memory_best_is_loaded(tmp_path):
    """Without a checkpoint folder the best epoch is kept in memory; evaluations every 2 epochs;
    the loop stops ``patience`` epochs after the best."""
    x, y, model = _toy()
    scores = {2: 0.1, 4: 0.9, 6: 0.5, 8: 0.4, 10: 0.3, 12: 0.2}  # the best at epoch 4
    seen = {}

    def evaluate(epoch):
        seen[epoch] = model.weight.detach().clone()
        return {"score": scores[epoch]}

    loop = _loop(
        model,
        x,
        y,
        tmp_path,
        epochs=12,
        evaluate=evaluate,
        evaluate_every=2,
        patience=4,
        select=("score", "max"),
        checkpoint_dir=None,
        metrics_path=None,
    )
    result = loop.run()
    assert sorted(seen) == [2, 4, 6, 8]  # evaluated every 2 epochs; stopped at 8 = best (4) + patience (4)
    assert loop.stopped_early and len(result.history) == 8 and result.best == {"epoch": 4, "value": 0.9}
    assert loop.load_best()
    torch.testing.assert_close(model.weight.detach(), seen[4])


def test_snapshot_holds_the_parameters_at_the_given_training_time(tmp_path, monkeypatch):
    """A fake clock that advances 1 s per optimizer step (and not otherwise): the snapshot is
    the state after the step that crossed 2.5 s (the 3rd), not the final one; a run shorter
    than the time leaves none."""
    import cfbnn_cli.train.loop as loop_module

    clock = [0.0]
    monkeypatch.setattr(loop_module.time, "perf_counter", lambda: clock[0])
    x, y, model = _toy()
    states = []
    original_step = TrainingLoop._step

    def step(self, rows, epoch, index):
        value = original_step(self, rows, epoch, index)
        clock[0] += 1.0
        states.append(self.model.weight.detach().clone())
        return value

    monkeypatch.setattr(TrainingLoop, "_step", step)
    loop = _loop(model, x, y, tmp_path, epochs=2, snapshot_after_seconds=2.5, checkpoint_dir=None, metrics_path=None)
    loop.run()
    assert len(states) == 8  # 2 epochs of 4 batches of 16
    torch.testing.assert_close(loop.snapshot["weight"], states[2])
    assert not torch.equal(loop.snapshot["weight"], states[-1])
    short = _loop(
        torch.nn.Linear(3, 1),
        x,
        y,
        tmp_path,
        epochs=1,
        snapshot_after_seconds=1e9,
        checkpoint_dir=None,
        metrics_path=None,
    )
    short.run()
    assert short.snapshot is None


def test_last_pt_and_metrics_are_written_at_the_first_and_last_epoch_and_by_time_between(tmp_path, monkeypatch):
    """Writing the whole history every epoch made a run's time grow with the square of its epochs:
    the first epoch, then every ``persist_seconds``, and the last; a resume redoes the epochs after
    the last write and ends where an uninterrupted run ends."""
    writes = []
    original = TrainingLoop._write_metrics
    monkeypatch.setattr(TrainingLoop, "_write_metrics", lambda self: writes.append(len(self.history)) or original(self))
    x, y, model = _toy()
    rare = _loop(model, x, y, tmp_path / "rare", epochs=30, persist_seconds=3600.0)
    rare.run()
    assert writes == [1, 30] and len(pd.read_csv(tmp_path / "rare" / "metrics.csv")) == 30
    writes.clear()
    x, y, model = _toy()
    _loop(model, x, y, tmp_path / "every", epochs=4, persist_seconds=0.0).run()
    assert writes == [1, 2, 3, 4]


def test_a_run_killed_between_writes_resumes_to_the_uninterrupted_result(tmp_path):
    x, y, model = _toy()
    _loop(model, x, y, tmp_path / "whole", epochs=10, persist_seconds=3600.0).run()
    uninterrupted = model.weight.detach().clone()

    def killed_at_6(epoch, row):
        if epoch == 6:
            raise KeyboardInterrupt

    x, y, model = _toy()
    with pytest.raises(KeyboardInterrupt):
        _loop(model, x, y, tmp_path / "killed", epochs=10, persist_seconds=3600.0, after_epoch=killed_at_6).run()
    x, y, _ = _toy()
    model = _toy(seed=5)[2]  # other starting weights: the checkpoint must bring the run back
    resumed = _loop(model, x, y, tmp_path / "killed", epochs=10, persist_seconds=3600.0, resume=True)
    assert resumed.restore() == 1  # the last write: after the first epoch
    resumed.run()
    torch.testing.assert_close(model.weight.detach(), uninterrupted, rtol=0.0, atol=0.0)
    assert list(pd.read_csv(tmp_path / "killed" / "metrics.csv")["epoch"]) == list(range(1, 11))
