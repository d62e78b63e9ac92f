"""report/numbers.py: mean ± s.e. rounded to the s.e.'s significant digit(s), single values, LaTeX cells."""

import math

import pytest

from cfbnn_cli.report.numbers import format_mean_se, format_value, latex_cell, se_decimals, split_mean_se


@pytest.mark.parametrize(
    "mean, se, expected",
    [
        (-107.1634, 0.0412, "-107.16 ± 0.04"),  # one digit of the s.e. (4), the mean to the same place
        (0.91234, 0.0137, "0.912 ± 0.014"),  # leading digits 13: two digits
        (0.91234, 0.0351, "0.912 ± 0.035"),  # 35 is still two digits
        (0.91234, 0.0361, "0.91 ± 0.04"),  # 36: one digit
        (5.0, 0.96, "5.0 ± 1.0"),  # 0.96 rounds up to the next decade: two digits of 1.0
        (1234.5, 47.0, "1230 ± 50"),  # rounding left of the decimal point
        (1234.5, 31.0, "1234 ± 31"),
        (3.14e-8, 4.1e-9, "(3.1 ± 0.4)e-8"),  # tiny numbers share one power of ten
        (2.5e6, 3.3e4, "(2.500 ± 0.033)e6"),
        (-0.0004, 0.01, "0.000 ± 0.010"),  # never "-0.000"
    ],
)
def test_mean_and_se_are_rounded_to_the_se(mean, se, expected):
    assert format_mean_se(mean, se) == expected


def test_the_rounded_se_is_within_15_percent_and_the_mean_within_half_a_last_digit():
    for exponent in range(-6, 5):
        for leading in (1.0, 1.49, 2.2, 3.5, 3.6, 5.0, 7.77, 9.4, 9.6):
            se = leading * 10.0**exponent
            mean = 7.123456789 * 10.0 ** (exponent + 2)
            text = format_mean_se(mean, se)
            m, s = split_mean_se(text)
            assert abs(s - se) <= 0.15 * se, (text, se)
            assert abs(m - mean) <= 0.5 * 10.0 ** -se_decimals(se) * (1 + 1e-9), (text, mean)


def test_no_se_one_replicate_and_a_zero_spread():
    assert format_mean_se(0.5, None) == "0.5000"  # one run: the mean alone, 4 significant digits
    assert format_mean_se(0.5, math.nan, sig=3) == "0.500"
    assert format_mean_se(0.977, 4.4e-16, sig=3) == "0.977 ± 0"  # floating-point noise of identical trials is zero
    assert format_mean_se(0.977, 0.0, sig=3) == "0.977 ± 0"
    assert format_mean_se(math.nan, 0.1) == "" and format_mean_se(None) == ""


def test_signed_and_plain_forms():
    assert format_mean_se(0.0123, 0.0021, signed=True) == "+0.0123 ± 0.0021"
    assert format_mean_se(-0.0123, 0.0021, signed=True) == "-0.0123 ± 0.0021"
    assert format_mean_se(0.0009, 0.0006, signed=True) == "(+9 ± 6)e-4"
    assert format_mean_se(0.0009, 0.0006, signed=True, scientific=False) == "+0.0009 ± 0.0006"


@pytest.mark.parametrize(
    "value, sig, expected",
    [
        (0.0262, 3, "0.0262"),
        (3.1e-8, 3, "3.10e-8"),
        (358.2, 3, "358"),
        (12345.6, 3, "12300"),
        (0.09996, 3, "0.100"),
        (1.0e5, 3, "1.00e5"),
        (-2.5e-4, 2, "-2.5e-4"),
        (1100.4, 2, "1100"),
        (0.0, 3, "0"),
    ],
)
def test_single_values_keep_significant_digits(value, sig, expected):
    assert format_value(value, sig=sig) == expected


def test_latex_cells():
    assert latex_cell("0.91 ± 0.01") == r"$0.91 \pm 0.01$"
    assert latex_cell("(3.1 ± 0.4)e-8") == r"$(3.1 \pm 0.4)\times 10^{-8}$"
    assert latex_cell("3.10e-8") == r"$3.10\times 10^{-8}$"
    assert latex_cell("Monte Carlo") == "Monte Carlo"
    assert split_mean_se("(3.1 ± 0.4)e-8") == pytest.approx((3.1e-8, 0.4e-8))
