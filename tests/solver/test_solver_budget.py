"""parse_budget: every accepted form, and errors that name the value and list the forms."""

from __future__ import annotations

import math

import pytest

from remat.core.budget import parse_budget
from remat.core.errors import BudgetError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (8_000_000_000, 8_000_000_000),
        (1, 1),
        ("8GB", 8 * 10**9),
        ("8 GB", 8 * 10**9),
        ("8gb", 8 * 10**9),
        ("8 gB ", 8 * 10**9),
        ("7.5GiB", 7.5 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512MB", 512 * 10**6),
        ("100KB", 100_000),
        ("100KiB", 102_400),
        ("100 kib", 102_400),
        ("1000B", 1000),
        ("1.5 TB", 1_500_000_000_000),
        ("2TiB", 2 * 2**40),
        ("7.3GB", 7_300_000_000),  # exact: no float rounding
        (".5KB", 500),
        ("1.0001KB", 1000),  # fractions of a byte round down
    ],
)
def test_accepted_forms(text: object, expected: int) -> None:
    result = parse_budget(text)
    assert result == expected
    assert isinstance(result, int)


@pytest.mark.parametrize(
    ("text", "reference", "expected"),
    [("60%", 1000, 600), ("100%", 12345, 12345), ("12.5%", 1001, 125), ("150 %", 10, 15)],
)
def test_percent_of_the_reference_peak(text: str, reference: int, expected: int) -> None:
    assert parse_budget(text, reference_peak_bytes=reference) == expected


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (True, "bool"),
        (False, "bool"),
        (0, "more than 0"),
        (-5, "more than 0"),
        ("8 gigs", "unknown unit 'gigs'"),
        ("8 PB", "unknown unit"),
        ("%", "expected a number"),
        ("GB", "expected a number"),
        ("8", "expected a number"),  # a bare number is ambiguous: bytes? GB?
        ("-8GB", "expected a number"),
        ("8e9B", "expected a number"),
        ("", "expected a number"),
        ("0GB", "at least 1 byte"),
        ("0.0001B", "at least 1 byte"),
        (math.nan, "not a finite number"),
        (math.inf, "not a finite number"),
        (8e9, "a float"),
        (None, "NoneType"),
        ([8], "list"),
    ],
)
def test_bad_budgets_name_the_value_and_list_the_forms(bad: object, why: str) -> None:
    with pytest.raises(BudgetError) as err:
        parse_budget(bad, reference_peak_bytes=1000)
    message = str(err.value)
    assert repr(bad) in message
    assert why in message
    for form in ("int of bytes", "GB", "GiB", "60%"):
        assert form in message
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("bad", ["60%", "0.5%"])
def test_percent_needs_a_reference(bad: str) -> None:
    with pytest.raises(BudgetError, match="no-checkpoint peak"):
        parse_budget(bad)


@pytest.mark.parametrize("bad", ["0%", "0.0%", "0.01%"])
def test_percent_must_give_at_least_a_byte(bad: str) -> None:
    with pytest.raises(BudgetError, match="more than 0%"):
        parse_budget(bad, reference_peak_bytes=100)
