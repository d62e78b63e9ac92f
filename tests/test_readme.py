"""The README's promises that code can check: its library example runs as printed and fits, its
links lead to files, and it stays a short guide."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _library_example() -> str:
    text = README.read_text(encoding="utf-8")
    after = text.split("<!-- library-example", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def test_the_readme_library_example_runs_and_fits():
    code = _library_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 12
    torch.manual_seed(0)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    model, x, y = namespace["model"], namespace["x"], namespace["y"]
    with torch.no_grad():
        mean, var_a, var_b, noise = model.predictive(x)
    rmse = float((mean - y).square().mean().sqrt())
    assert rmse < 0.5 * float(y.std())  # it learned the function, not the mean
    assert bool(((var_a + var_b + noise) > 0).all())


def test_the_readme_is_a_short_guide_whose_links_resolve():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert (README.parent / target).exists(), target
