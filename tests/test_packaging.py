"""The wheel works outside the checkout: it carries conf/ and the CLI finds it from any directory. It is
built without a working compiler (``CXX=/bin/false``): the build succeeds, says so in one line, and the
installed package computes on the operators' reference kernels."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_wheel_installed_elsewhere_composes_every_command(tmp_path):
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-v",  # (pip shows a successful build's own output only with -v)
            "-w",
            str(tmp_path / "wheel"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, CXX="/bin/false"),  # (no compiler: the install must still succeed)
    )
    assert built.returncode == 0, built.stderr[-3000:]
    said = [line.strip() for line in built.stderr.splitlines() if line.strip().startswith("cfbnn:")]
    assert len(said) == 1 and "/bin/false" in said[0] and "the reference kernels will serve" in said[0], said
    wheel = next((tmp_path / "wheel").glob("cfbnn-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        assert not [name for name in archive.namelist() if name.startswith("cfbnn_cli/moments/_C")]
    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert (site / "cfbnn_cli" / "conf" / "train_regression" / "train_regression.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the installed copy first on the path (ahead of the checkout's editable install); no CFBNN_CONFIG_DIR
    env = {k: v for k, v in os.environ.items() if k != "CFBNN_CONFIG_DIR"}
    env["PYTHONPATH"] = str(site)
    script = (
        "import cfbnn_cli, cfbnn_cli.cli as cli\n"
        "print(cfbnn_cli.__file__)\n"
        "print(cli.config_dir())\n"
        "for name in ('train_regression', 'vae', 'imagenet_predict'):\n"
        "    cfg = cli.compose_config(name, ['seed=3'])\n"
        "    assert cfg.seed == 3 and 'trainer' in cfg, name\n"
        "print('composed')\n"
        "import torch, warnings\n"
        "from cfbnn_cli.moments import extension, get_activation\n"
        "phi = get_activation('relu').moments(torch.zeros(2), torch.ones(2))[0]\n"
        "print(extension.status()['loaded'], round(float(phi[0]), 6))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    package_file, conf, composed, loaded, phi = out.stdout.split()
    assert package_file.startswith(str(site)) and conf == str(site / "cfbnn_cli" / "conf") and composed == "composed"
    assert loaded == "False" and phi == "0.398942"  # (E[max(0, z)] = 1/sqrt(2 pi), on the reference kernels)
    helped = subprocess.run(
        [sys.executable, "-m", "cfbnn_cli.cli", "vae", "--help"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        helped.returncode == 0
        and "data: digits, fashion_mnist, fashion_mnist_pca90, synthetic, year_prediction_msd" in helped.stdout
    )
