"""Numbers as a paper prints them: a mean rounded to what its standard error supports.

:func:`format_mean_se` is the one helper every cfbnn table uses for ``mean ± s.e.``
(Table 1, Table 2, Figure 1's tables, ``cfbnn report``, the UCI protocol); use it for
any new table so that all of them round alike. :func:`format_value` formats a single
number without an uncertainty (to ``sig`` significant digits), and
:func:`latex_cell` turns either form into LaTeX.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Optional, Tuple

__all__ = ["format_mean_se", "format_value", "latex_cell", "se_decimals"]

# below this share of |mean| a standard error is rounding noise of a constant (an s.d. of
# 4.4e-16 over identical trials), not a spread
_ZERO_SE = 1e-9
# outside [1e-3, 1e5) a number is written as (mantissa)e<exponent>
_SMALL, _LARGE = 1e-3, 1e5


def _finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def se_decimals(se: float) -> int:
    """The decimal place to round to (``round(x, decimals)``) for a standard error ``se > 0``.

    The s.e. keeps its first significant digit, or its first two when they read 10-35
    (the Particle Data Group's rule: 0.12 stays 0.12, 0.4 stays 0.4, 0.96 becomes 1.0),
    so that rounding never changes the s.e. by more than about 15 %.
    """
    exponent = math.floor(math.log10(se))
    leading = se / 10.0**exponent  # in [1, 10)
    if round(leading, 1) >= 9.5:  # rounds up to the next decade: 0.96 -> 1.0 (two digits)
        exponent += 1
        leading = 1.0
    digits = 2 if leading < 3.55 else 1
    return digits - 1 - exponent


def _plain(value: float, decimals: int) -> str:
    rounded = round(value, decimals)
    return f"{rounded if rounded != 0 else 0.0:.{max(decimals, 0)}f}"  # never "-0.00"


def format_mean_se(mean, se=None, *, sig: int = 4, signed: bool = False, scientific: bool = True) -> str:
    """``"mean ± se"`` with both rounded to the s.e.'s first significant digit(s).

    * ``se`` is rounded by :func:`se_decimals` (one significant digit, two when they
      read 10-35) and the mean to the same decimal place: ``format_mean_se(-107.1634,
      0.0412) == "-107.16 ± 0.04"``, ``format_mean_se(0.91234, 0.0137) == "0.912 ± 0.014"``,
      ``format_mean_se(1234.5, 47) == "1230 ± 50"``.
    * No usable s.e. (``None``, NaN: one replicate) gives the mean alone to ``sig``
      significant digits; an s.e. of zero (or below 1e-9 of |mean|, floating-point
      noise of identical values) gives ``"mean ± 0"`` with the mean to ``sig`` digits.
    * Very small or large numbers (max(|mean|, se) < 1e-3 or ≥ 1e5) share one power of ten:
      ``format_mean_se(3.14e-8, 4.1e-9) == "(3.1 ± 0.4)e-8"``.
      ``scientific=False`` keeps plain decimals for small numbers (differences of
      accuracies beside accuracies: ``"+0.0009 ± 0.0006"``).
    * A mean that is not finite gives ``""`` (an empty cell); ``signed`` prints ``+``
      for positive means (differences).
    """
    if not _finite(mean):
        return ""
    mean = float(mean)
    if not _finite(se) or float(se) < 0:
        return format_value(mean, sig=sig, signed=signed, scientific=scientific)
    se = float(se)
    if se == 0 or se <= _ZERO_SE * abs(mean):
        return f"{format_value(mean, sig=sig, signed=signed, scientific=scientific)} ± 0"
    magnitude = max(abs(mean), se)
    if scientific and (magnitude < _SMALL or magnitude >= _LARGE):
        exponent = math.floor(math.log10(magnitude))
        inner = format_mean_se(_shifted(mean, -exponent), _shifted(se, -exponent), sig=sig, signed=signed)
        return f"({inner})e{exponent}"
    decimals = se_decimals(se)
    m, s = _plain(mean, decimals), _plain(se, decimals)
    if signed and not m.startswith("-") and float(m) != 0:
        m = "+" + m
    return f"{m} ± {s}"


def format_value(value, *, sig: int = 3, signed: bool = False, scientific: bool = True) -> str:
    """One number to ``sig`` significant digits (trailing zeros kept, no exponent
    between 1e-3 and 1e5): ``format_value(0.0262) == "0.0262"``,
    ``format_value(3.1e-8) == "3.10e-8"``, ``format_value(358.2) == "358"``,
    ``format_value(12345.6) == "12300"``. ``""`` for a value that is not finite;
    ``scientific=False``: plain decimals however small (``"0.0000310"``)."""
    if not _finite(value):
        return ""
    value = float(value)
    sign = "+" if signed and value > 0 else ""
    if value == 0:
        return "0"
    digits = f"{value:.{sig - 1}e}"  # the digits, e.g. 0.09996 -> 1.00e-01 at sig 3
    rounded = float(digits)
    exponent = int(digits.rsplit("e", 1)[1])
    if scientific and (abs(rounded) < _SMALL or abs(rounded) >= _LARGE):
        return f"{sign}{digits.rsplit('e', 1)[0]}e{exponent}"  # no division: 5e-324 has no 1e-324
    decimals = max(sig - 1 - exponent, 0)
    return f"{sign}{rounded:.{decimals}f}"


def _shifted(value: float, places: int) -> float:
    """``value * 10**places`` exactly where floats cannot hold ``10**places`` (a subnormal's scale)."""
    return float(Decimal(value).scaleb(places))


PM, TIMES = r"\pm", r"\times "
_SCIENTIFIC = re.compile(r"^\((?P<inner>.*)\)e(?P<exp>-?\d+)$|^(?P<mant>[-+]?[\d.]+)e(?P<exp2>-?\d+)$")


def latex_cell(text: str) -> str:
    """A cell written by :func:`format_mean_se`/:func:`format_value` in LaTeX math:
    ``"0.91 ± 0.01"`` -> ``"$0.91 \\pm 0.01$"``, ``"(3.1 ± 0.2)e-8"`` ->
    ``"$(3.1 \\pm 0.2)\\times 10^{-8}$"``; any other text is returned unchanged."""
    text = str(text)
    match = _SCIENTIFIC.match(text.strip())
    if match:
        if match.group("inner") is not None:
            inner, exponent = match.group("inner"), match.group("exp")
            return "$(" + inner.replace("±", PM) + ")" + TIMES + "10^{" + str(int(exponent)) + "}$"
        return "$" + match.group("mant") + TIMES + "10^{" + str(int(match.group("exp2"))) + "}$"
    if re.fullmatch(r"[-+]?[\d.]+ ± [\d.]+", text.strip()):
        return "$" + text.strip().replace("±", PM) + "$"
    return text


def split_mean_se(text: str) -> Tuple[Optional[float], Optional[float]]:
    """The numbers back from a :func:`format_mean_se` cell (for tests and readers of the CSVs)."""
    text = str(text).strip()
    scale = 1.0
    match = re.fullmatch(r"\((.*)\)e(-?\d+)", text)
    if match:
        text, scale = match.group(1), 10.0 ** int(match.group(2))
    parts = [p.strip() for p in text.split("±")]
    mean = float(parts[0]) * scale if parts[0] else None
    se = float(parts[1]) * scale if len(parts) > 1 else None
    return mean, se
