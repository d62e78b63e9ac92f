"""report/ (aggregate, records, grouping, sections, reproduction): `cfbnn report` groups runs, gives mean and standard error, one table per
pipeline protocol, flags duplicates, draws the tables and figures, and --paper's reproduction table."""

import json
import math

import pandas as pd
import pytest

from cfbnn_cli.report.aggregate import report
from cfbnn_cli.report.grouping import drop_duplicates, swept_keys
from cfbnn_cli.report.numbers import split_mean_se
from cfbnn_cli.report.reproduction import command_for
from cfbnn_cli.runtime.errors import DataError


def _write_run(folder, pipeline, config, metrics, overrides=None, wall_s=60.0):
    folder.mkdir(parents=True)
    record = {
        "pipeline": pipeline,
        "schema": 1,
        "status": "complete",
        "config": config,
        "metrics": metrics,
        "timing": {"wall_s": wall_s},
    }
    (folder / "results.json").write_text(json.dumps(record))
    if overrides is not None:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))


def test_report_on_hand_made_runs_gives_the_known_mean_and_standard_error(tmp_path, capsys):
    values = {
        ("analytic", 0): 1.0,
        ("analytic", 1): 3.0,
        ("analytic", 2): 5.0,
        ("sampling", 0): 10.0,
        ("sampling", 1): 14.0,
    }
    for i, ((estimator, seed), value) in enumerate(values.items()):
        config = {"seed": seed, "estimator": {"name": estimator}, "trainer": {"epochs": 3}, "device": "cpu"}
        _write_run(tmp_path / str(i), "train_regression", config, {"final_test_rmse": value, "other": None})
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "results.json").write_text("{ truncated")
    written = report(tmp_path)
    out = capsys.readouterr()
    assert f"skipping {tmp_path / '9' / 'results.json'}" in out.err  # the corrupt file is named, the rest aggregated
    summary = pd.read_csv(tmp_path / "report_train_regression.csv")
    rmse = summary[summary["metric"] == "final_test_rmse"].set_index("estimator.name")
    assert list(summary.columns[:2]) == ["estimator.name", "metric"]  # grouped by the swept key only
    assert rmse.loc["analytic", "mean"] == pytest.approx(3.0) and rmse.loc["analytic", "n"] == 3
    assert rmse.loc["analytic", "se"] == pytest.approx(2.0 / math.sqrt(3))  # sd of (1, 3, 5) is 2
    assert rmse.loc["sampling", "mean"] == pytest.approx(12.0)
    assert rmse.loc["sampling", "se"] == pytest.approx(math.sqrt(8.0) / math.sqrt(2))
    table = pd.read_csv(tmp_path / "report_train_regression_table.csv").set_index("estimator.name")
    # s.e. 1.1547 keeps two digits (leading 1), the mean follows; 2.0 likewise
    assert table.loc["analytic", "Test RMSE"] == "3.0 ± 1.2"
    assert table.loc["sampling", "Test RMSE"] == "12.0 ± 2.0"
    assert list(table["runs"]) == [3, 2] and list(table["seeds"]) == ["0,1,2", "0,1"]
    assert "5 runs in 2 groups by estimator.name" in out.out  # the count printed is the table's
    assert "report_train_regression_table.tex" in written["train_regression"]
    assert r"$3.0 \pm 1.2$" in (tmp_path / "report_train_regression_table.tex").read_text()


def test_report_makes_table_2_from_single_variant_runs(tmp_path):
    for i, (variant, seed, value) in enumerate([("v1", 0, -10.0), ("v1", 1, -12.0), ("v3", 0, -9.0), ("v3", 1, -9.5)]):
        _write_run(
            tmp_path / str(i),
            "vae",
            {"variant": variant, "seed": seed, "data": {"seed": seed}},
            {f"vae/{variant}/test_ll": value},
        )
    report(tmp_path)
    table = pd.read_csv(tmp_path / "report_vae_table.csv", index_col="Variant")
    assert list(table.index) == ["V1", "V3"]
    assert table.loc["V1", "Test LL (mean ± s.e. over runs)"] == "-11.0 ± 1.0"
    assert split_mean_se(table.loc["V3", "Test LL (mean ± s.e. over runs)"]) == pytest.approx((-9.25, 0.25))
    assert list(table["runs"]) == [2, 2]
    assert (tmp_path / "report_vae.png").read_bytes()[:4] == b"\x89PNG"


def _table1_metrics(scale):
    metrics = {"final_test_rmse": 0.7, "train/converged": 0.0}
    for epoch in (0, 10):
        for layer in ("first", "second", "final"):
            for kind, base in (("mean", 1.0), ("scale", 1e-6)):
                analytic, sampling = base, base * scale[layer][kind]
                metrics[f"gradvar/analytic/epoch{epoch}/{layer}/{kind}"] = analytic
                metrics[f"gradvar/sampling/epoch{epoch}/{layer}/{kind}"] = sampling
                metrics[f"gradvar_ratio_sampling_over_analytic/epoch{epoch}/{layer}/{kind}"] = sampling / analytic
    return metrics


RATIOS = {
    "first": {"mean": 2.0, "scale": 1.0},
    "second": {"mean": 4.0, "scale": 100.0},
    "final": {"mean": 3.0, "scale": 1e4},
}


def test_gradient_variance_and_uci_runs_get_separate_non_empty_tables(tmp_path, capsys):
    for seed in (0, 1):
        scaled = {layer: {kind: r * (1 + 0.1 * seed) for kind, r in kinds.items()} for layer, kinds in RATIOS.items()}
        _write_run(
            tmp_path / f"gv{seed}",
            "train_regression",
            {
                "seed": seed,
                "protocol": "gradient_variance",
                "estimator": "analytic",
                "trainer": {"epochs": 10},
                "data": {"name": "synthetic", "seed": seed},
            },
            _table1_metrics(scaled),
        )
    _write_run(
        tmp_path / "uci",
        "train_regression",
        {
            "seed": 0,
            "protocol": "uci",
            "uci": {"n_splits": 10},
            "trainer": {"epochs": 80},
            "data": {"name": "diabetes"},
        },
        {
            "uci/closed_form_diagonal/test_ll_mean": -5.503,
            "uci/closed_form_diagonal/test_ll_se": 0.028,
            "uci/closed_form_diagonal/rmse_mean": 58.335,
            "uci/closed_form_diagonal/rmse_se": 2.16,
            "uci/pyro/test_ll_mean": -5.612,
            "uci/pyro/test_ll_se": 0.031,
            "uci/pyro/rmse_mean": 62.75,
            "uci/pyro/rmse_se": 3.217,
        },
    )
    written = report(tmp_path)
    assert set(written) == {"train_regression/gradient_variance", "train_regression/uci"}
    table1 = pd.read_csv(tmp_path / "report_train_regression_gradient_variance_table.csv").set_index("Estimator")
    assert list(table1.index) == ["Analytic", "Sampling", "Ratio sampling / analytic"]
    ratio = table1.loc["Ratio sampling / analytic", "Upon initialization (epoch 0): Second Layer"]
    means, scales = ratio.split(" / ")
    assert split_mean_se(means) == pytest.approx((4.2, 0.2))  # 4 and 4.4: mean 4.2, s.e. 0.2
    assert split_mean_se(scales)[0] == pytest.approx(105.0)
    assert "End of training (epoch 10, not converged): First Layer" in table1.columns
    assert (table1["runs"] == 2).all()
    uci = pd.read_csv(tmp_path / "report_train_regression_uci_table.csv").set_index("Method")
    assert uci.loc["closed_form_diagonal", "Test LL (± s.e. over splits)"] == "-5.503 ± 0.028"  # one run: its own s.e.
    assert uci.loc["pyro", "RMSE (± s.e. over splits)"] == "62.8 ± 3.2"
    assert (tmp_path / "report_train_regression_gradient_variance.png").exists()


def test_identical_runs_with_the_same_seed_are_duplicates_not_replicates(tmp_path, capsys):
    config = {"seed": 0, "variant": "v1", "data": {"name": "digits", "seed": 0}, "device": "cpu"}
    _write_run(tmp_path / "a", "vae", config, {"vae/v1/test_ll": -10.0})
    _write_run(tmp_path / "b", "vae", {**config, "device": "cuda"}, {"vae/v1/test_ll": -10.0})  # the same experiment
    _write_run(
        tmp_path / "c", "vae", {**config, "seed": 1, "data": {"name": "digits", "seed": 1}}, {"vae/v1/test_ll": -12.0}
    )
    report(tmp_path)
    out = capsys.readouterr()
    assert f"duplicate of {tmp_path / 'a'}" in out.err and str(tmp_path / "b") in out.err
    table = pd.read_csv(tmp_path / "report_vae_table.csv", index_col="Variant")
    assert table.loc["V1", "runs"] == 2 and table.loc["V1", "seeds"] == "0,1"
    assert table.loc["V1", "Test LL (mean ± s.e. over runs)"] == "-11.0 ± 1.0"  # not ± 0 from the copy
    assert "vae: Table 2, VAE; 2 runs" in out.out
    kept, duplicates = drop_duplicates(
        [json.loads((tmp_path / d / "results.json").read_text()) | {"_path": d} for d in "abc"]
    )
    assert [r["_path"] for r in kept] == ["a", "c"] and [(d["_path"], k["_path"]) for d, k in duplicates] == [
        ("b", "a")
    ]


def test_runs_on_different_data_files_are_groups_not_replicates(tmp_path, capsys):
    """data.path is not a factor (one file at two paths is one experiment), but the file's content
    is: runs on two files with the same config and seed were averaged as replicates."""
    contents = {"a": "120:aaaa1111bbbb2222", "b": "120:aaaa1111bbbb2222", "c": "98:cccc3333dddd4444"}
    for name, (seed, path, rmse) in {
        "a": (0, "/x/one.csv", 1.0),
        "b": (1, "/y/one.csv", 3.0),
        "c": (0, "/x/two.csv", 50.0),
    }.items():
        config = {"seed": seed, "data": {"name": "csv", "path": path}, "estimator": {"name": "analytic"}}
        _write_run(tmp_path / name, "train_regression", config, {"final_test_rmse": rmse})
        (tmp_path / name / ".cfbnn").mkdir()
        record = {"config_fingerprint": name, "config": {"data.path": path, "data.path#content": contents[name]}}
        (tmp_path / name / ".cfbnn" / "config.json").write_text(json.dumps(record))
    report(tmp_path)
    assert "3 runs in 2 groups by data.path#content" in capsys.readouterr().out
    table = pd.read_csv(tmp_path / "report_train_regression_table.csv").set_index("data.path#content")
    # each file by its name (not its size and hash): one file at two paths is one row
    assert table.loc["one.csv", "Test RMSE"] == "2.0 ± 1.0" and table.loc["one.csv", "runs"] == 2
    assert table.loc["two.csv", "Test RMSE"] == "50.00" and table.loc["two.csv", "runs"] == 1


def test_keys_that_follow_the_seed_are_replicates_not_factors():
    runs = [
        {"config": {"seed": s, "data": {"seed": s, "name": "synthetic"}, "trainer": {"lr": lr}}}
        for s in (0, 1)
        for lr in (0.1, 0.01)
    ]
    assert swept_keys(runs) == ["trainer.lr"]


def test_a_section_without_any_metric_is_an_error_not_an_empty_table(tmp_path):
    _write_run(tmp_path / "a", "train_regression", {"seed": 0, "protocol": "uci"}, {})
    with pytest.raises(DataError, match="no metric to tabulate"):
        report(tmp_path)


def _figure1_metrics(det, mc, k=3):
    metrics = {"evaluation/top_k": k, "deterministic/top1": det[0], f"deterministic/top{k}": det[1]}
    for n, (top1, topk) in mc.items():
        metrics.update(
            {
                f"monte_carlo/N{n}/top1_mean": top1,
                f"monte_carlo/N{n}/top{k}_mean": topk,
                f"monte_carlo/N{n}/top1_sd": 0.01,
                f"monte_carlo/N{n}/top{k}_sd": 0.01,
            }
        )
    return metrics


def test_paper_reproduction_table_from_hand_made_runs(tmp_path, capsys):
    for seed in (0, 1, 2):
        scaled = {layer: {kind: r * (1 + 0.05 * seed) for kind, r in kinds.items()} for layer, kinds in RATIOS.items()}
        _write_run(
            tmp_path / "t1" / str(seed),
            "train_regression",
            {"seed": seed, "protocol": "gradient_variance", "trainer": {"epochs": 10}, "data": {"name": "synthetic"}},
            _table1_metrics(scaled),
            overrides=[f"seed={seed}"],
            wall_s=60,
        )
        # V3 beats V1 by 1 in every seed, V2 is V3 minus 0.1 +- noise
        _write_run(
            tmp_path / "t2" / str(seed),
            "vae",
            {"seed": seed, "variant": "all", "data": {"name": "digits"}},
            {
                "vae/v1/test_ll": -110.0 - seed,
                "vae/v2/test_ll": -109.0 - seed + 0.1 * (seed - 1),
                "vae/v3/test_ll": -109.0 - seed,
            },
            overrides=[f"seed={seed}", "trainer.epochs=300"],
            wall_s=120,
        )
        # deterministic 0.80 / 0.95; MC reaches 0.80 top-1 at N=64, never reaches 0.95 top-3
        _write_run(
            tmp_path / "f1" / str(seed),
            "imagenet_predict",
            {"seed": seed, "data": {"name": "digits"}},
            _figure1_metrics((0.80, 0.95), {1: (0.60, 0.90), 8: (0.75, 0.93), 64: (0.80, 0.94), 512: (0.80, 0.94)}),
            overrides=[f"seed={seed}", "data.train_size=100"],
            wall_s=30,
        )
    written = report(tmp_path, paper=True)
    assert written["paper"] == ["paper_reproduction.md", "paper_reproduction.csv"]
    frame = pd.read_csv(tmp_path / "paper_reproduction.csv").set_index("Claim")
    second_scale = frame.loc[
        "Table 1, at initialization, second layer, log σ: gradient variance sampling / analytic > 1"
    ]
    assert second_scale["Paper"] == "100 (0.0002 / 2e-06)"  # the paper's cells as printed in its source
    assert split_mean_se(second_scale["cfbnn (stand-in data)"]) == pytest.approx((105.0, 2.9))  # 100, 105, 110
    assert second_scale["Shown?"] == "yes"
    first_scale = frame.loc["Table 1, at initialization, first layer, log σ: gradient variance sampling / analytic ≈ 1"]
    assert first_scale["Shown?"].startswith("yes")
    v3_v1 = frame.loc["Table 2, V3 ≥ V1: a Bayesian decoder (integrated) beats a point estimate: test LL V3 − V1"]
    assert (
        v3_v1["Paper"].startswith("+0.06") and v3_v1["cfbnn (stand-in data)"] == "+1.00 ± 0 (median +1.00; 3 of 3 > 0)"
    )
    assert v3_v1["Shown?"] == "yes"
    v3_v2 = frame.loc["Table 2, V3 ≥ V2: integrating the weights out beats sampling them: test LL V3 − V2"]
    assert v3_v2["Shown?"].startswith("not resolved")  # differences -0.1, 0, +0.1 ... mean 0
    assert v3_v2["cfbnn (stand-in data)"] == ("0.00 ± 0.06 (median 0.00; 1 of 3 > 0)")
    top1 = frame.loc["Figure 1, top-1 accuracy: deterministic − Monte Carlo with N_inner = 512"]
    assert top1["Shown?"].startswith("not resolved") and top1["Paper"] == "deterministic ≥ MC-512 (qualitative)"
    top3 = frame.loc["Figure 1, top-3 accuracy: deterministic − Monte Carlo with N_inner = 512"]
    assert top3["cfbnn (stand-in data)"].startswith("+0.0100 ± 0") and top3["Shown?"] == "yes"
    reach = frame.loc["Figure 1, top-1: Monte Carlo needs many samples to reach the deterministic accuracy"]
    assert "reaches the deterministic accuracy at N_inner = 64" in reach["cfbnn (stand-in data)"]
    assert reach["Shown?"].startswith("partly")
    never = frame.loc["Figure 1, top-3: Monte Carlo needs many samples to reach the deterministic accuracy"]
    assert "stays below the deterministic accuracy up to N_inner = 512" in never["cfbnn (stand-in data)"]
    assert never["Shown?"] == "yes"
    assert top1["Command"] == "cfbnn imagenet-predict -m data.train_size=100 seed=0,1,2"
    assert v3_v1["Command"] == "cfbnn vae -m seed=0,1,2 trainer.epochs=300"
    assert v3_v1["Runs"] == "digits; 3 runs (seeds 0,1,2); 6.0 min of runs"
    assert "Reproducing the paper" in capsys.readouterr().out


def test_command_is_rebuilt_from_the_runs_overrides(tmp_path):
    runs = []
    for seed in (0, 1, 2):
        _write_run(
            tmp_path / str(seed),
            "train_regression",
            {"seed": seed},
            {"m": 1.0},
            overrides=[f"seed={seed}", f"hydra.sweep.dir={tmp_path}", "trainer.epochs=5"],
        )
        runs.append(
            json.loads((tmp_path / str(seed) / "results.json").read_text()) | {"_path": str(tmp_path / str(seed))}
        )
    assert command_for(runs) == "cfbnn train regression -m seed=0,1,2 trainer.epochs=5"
    assert command_for(runs[:1]) == "cfbnn train regression seed=0 trainer.epochs=5"


def test_table2_claims_are_per_group_never_pooled_and_carry_the_second_reading(tmp_path):
    """Digits runs and two Fashion-MNIST sizes under one folder: each group gets its own
    claims (V3 − V1 = +1 on digits, −2 on Fashion-MNIST, never averaged together), and where
    the runs hold the posterior-mean reading, its differences are claims of their own."""
    for seed in (0, 1, 2):
        _write_run(
            tmp_path / "digits" / str(seed),
            "vae",
            {"seed": seed, "variant": "all", "data": {"name": "digits"}},
            {"vae/v1/test_ll": -110.0 - seed, "vae/v2/test_ll": -110.0 - seed, "vae/v3/test_ll": -109.0 - seed},
            overrides=[f"seed={seed}"],
        )
        for rows in (10000, 20000):
            _write_run(
                tmp_path / f"fm{rows}" / str(seed),
                "vae",
                {"seed": seed, "variant": "all", "data": {"name": "fashion_mnist", "rows": rows}},
                {
                    "vae/v1/test_ll": 600.0 + seed,
                    "vae/v2/test_ll": 599.0 + seed,
                    "vae/v3/test_ll": 598.0 + seed,
                    "vae/v1/test_ll_posterior_mean": 600.0 + seed,
                    "vae/v2/test_ll_posterior_mean": 590.0 + seed,
                    "vae/v3/test_ll_posterior_mean": 603.0 + seed,
                },
                overrides=[f"seed={seed}", "experiment=table2_fashion_mnist", f"data.rows={rows}"],
            )
        _write_run(  # the principal-component stand-in: V3 − V1 = +0.5
            tmp_path / "pca90" / str(seed),
            "vae",
            {"seed": seed, "variant": "all", "data": {"name": "fashion_mnist_pca90", "components": 90}},
            {"vae/v1/test_ll": -90.0 - seed, "vae/v2/test_ll": -89.8 - seed, "vae/v3/test_ll": -89.5 - seed},
            overrides=[f"seed={seed}", "experiment=table2_fashion_mnist_pca90"],
        )
    report(tmp_path, paper=True)
    frame = pd.read_csv(tmp_path / "paper_reproduction.csv")
    v3_v1 = frame[
        frame["Claim"] == "Table 2, V3 ≥ V1: a Bayesian decoder (integrated) beats a point estimate: test LL V3 − V1"
    ]
    by_group = dict(zip((r.split("; ")[-1] for r in v3_v1["Runs"]), v3_v1["cfbnn (stand-in data)"]))
    assert by_group == {
        "data.components=—, data.name=digits, data.rows=—": "+1.00 ± 0 (median +1.00; 3 of 3 > 0)",
        "data.components=—, data.name=fashion_mnist, data.rows=10000": "-2.00 ± 0 (median -2.00; 0 of 3 > 0)",
        "data.components=—, data.name=fashion_mnist, data.rows=20000": "-2.00 ± 0 (median -2.00; 0 of 3 > 0)",
        # the stand-in's own rows, beside the others, never pooled with them
        "data.components=90, data.name=fashion_mnist_pca90, data.rows=—": "+0.500 ± 0 (median +0.500; 3 of 3 > 0)",
    }
    plug_in = frame[frame["Claim"].str.endswith("V3 − V1 [decoder weights at their posterior means]")]
    assert (
        list(plug_in["cfbnn (stand-in data)"]) == ["+3.00 ± 0 (median +3.00; 3 of 3 > 0)"] * 2
    )  # the Fashion-MNIST groups only
    assert all(plug_in["Shown?"] == "yes")
    table = pd.read_csv(tmp_path / "report_vae_table.csv")
    assert set(table["Test LL, weights at posterior mean"]) >= {"—"}


def test_the_matmul_precision_is_a_factor_and_an_unrecorded_one_is_highest():
    """TF32 changes a run's numbers, so runs at runtime.matmul_precision=high are not replicates
    of runs at highest; a run recorded before the key existed multiplied at torch's default."""
    runs = [
        {"pipeline": "train_regression", "config": {"seed": s, "runtime": {"threads": threads, **precision}}}
        for s, threads, precision in (
            (0, 1, {"matmul_precision": "highest"}),
            (1, 2, {}),  # recorded before the key existed
            (0, 1, {"matmul_precision": "high"}),
        )
    ]
    assert swept_keys(runs) == ["runtime.matmul_precision"]  # the thread count is still no factor
    assert swept_keys(runs[:2]) == []  # the unrecorded run is a replicate of the highest one
    same_seed = [runs[0], runs[2]]
    kept, duplicates = drop_duplicates([r | {"_path": str(i)} for i, r in enumerate(same_seed)])
    assert len(kept) == 2 and not duplicates  # the same seed at another precision is no duplicate
