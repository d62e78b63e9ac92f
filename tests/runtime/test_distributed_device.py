"""runtime/distributed.py: which GPU each torchrun process takes, from the one ``device`` key (parsed by
runtime/device.py, as everywhere): ``cuda:N`` was treated as the CPU before (gloo, no GPU)."""

import pytest
import torch

from cfbnn_cli.run_values import parse_run_values
from cfbnn_cli.runtime import distributed
from cfbnn_cli.runtime.errors import ConfigError


def _device(spec):  # the run's device, parsed once at the command's boundary
    return parse_run_values({"device": spec}).device


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


@pytest.mark.parametrize("device, first", [("auto", 0), ("cuda", 0), ("cuda:1", 1), ("cuda:3", 3), ("cpu", None)])
def test_the_first_gpu_follows_the_device_key(four_gpus, device, first):
    assert distributed.first_gpu(_device(device)) == first


def test_without_cuda_every_process_is_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert distributed.first_gpu(_device("auto")) is None
    with pytest.raises(ConfigError, match="CUDA is not available"):
        distributed.first_gpu(_device("cuda:1"))


def test_more_processes_than_gpus_from_the_first_one_is_refused(four_gpus, tmp_path):
    from omegaconf import OmegaConf

    with pytest.raises(ConfigError, match=r"needs GPUs 3\.\.4 .* 4 are visible"):
        cfg = OmegaConf.create({"device": "cuda:3"})
        distributed.launch(cfg, tmp_path, 2, ["-c", "pass"], device=_device("cuda:3"))
