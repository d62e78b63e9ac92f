"""The wheel works outside the checkout: it carries conf/ and the CLI finds it from any directory."""

import os
import subprocess
import sys
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
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, CXX="/bin/false"),  # (conf/ is what is checked here: not a minute of C++ build)
    )
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "wheel").glob("cfbnn-*.whl"))
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
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    package_file, conf, composed = out.stdout.split()
    assert package_file.startswith(str(site)) and conf == str(site / "cfbnn_cli" / "conf") and composed == "composed"
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
