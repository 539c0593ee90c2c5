"""autoaccum.units: byte sizes users type, and the ones we print."""

import math

import pytest

from autoaccum.units import counted, format_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("8 GiB", 8 * 2**30),
    ("8GiB", 8 * 2**30),
    (" 8 gib ", 8 * 2**30),
    ("8GB", 8 * 10**9),
    ("8 gb", 8 * 10**9),
    ("8589934592", 8589934592),
    (8589934592, 8589934592),
    ("1.5 KiB", 1536),
    ("512MiB", 512 * 2**20),
    ("2 TiB", 2 * 2**40),
    ("1e3", 1000),
    ("64 kB", 64_000),
    ("100 B", 100),
    (1.0, 1),
])
def test_accepted_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("value", [0, -1, "0", "0 GiB", 0.5, "0.5B", math.inf, math.nan, "1e400", "-8GiB", "-1e9"])
def test_non_positive_or_infinite_budget_is_a_value_error_naming_value_and_range(value):
    with pytest.raises(ValueError, match=r"Invalid budget .*at least 1 byte.*Allowed range"):
        parse_bytes(value)


@pytest.mark.parametrize("text", ["eight", "8 XB", "GiB", "", "8.5.1 GB", "--8GiB", "8 G iB", "8GiBs"])
def test_unparsable_budget_names_the_value_and_the_accepted_units(text):
    with pytest.raises(ValueError) as info:
        parse_bytes(text)
    assert repr(text) in str(info.value)
    assert "GiB" in str(info.value) and "8589934592" in str(info.value)


@pytest.mark.parametrize("value", [None, [8], True, b"8GiB"])
def test_wrong_type_is_a_type_error(value):
    with pytest.raises(TypeError, match="budget must be a number of bytes"):
        parse_bytes(value)


def test_the_name_appears_in_the_message():
    with pytest.raises(ValueError, match="Invalid memory_limit"):
        parse_bytes("lots", name="memory_limit")


@pytest.mark.parametrize("num_bytes, text", [
    (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (8 * 2**30, "8 GiB"), (6.1 * 2**30, "6.1 GiB"),
    (57.6 * 2**20, "57.6 MiB"), (3 * 2**40, "3 TiB"), (5000 * 2**40, "5000 TiB"), (-2048, "-2 KiB"),
])
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize("num_bytes", [1, 1536, 8 * 2**30, 3 * 2**40])
def test_format_then_parse_round_trips_exact_binary_sizes(num_bytes):
    assert parse_bytes(format_bytes(num_bytes)) == num_bytes


def test_counted_says_one_and_many():
    assert [counted(1, "step"), counted(2, "step"), counted(0, "OOM"), counted(1_000, "sample")] == \
        ["1 step", "2 steps", "0 OOMs", "1,000 samples"]
    assert counted(1, "pass", "passes") == "1 pass" and counted(3, "pass", "passes") == "3 passes"


@pytest.mark.parametrize("text", ["64Gb", "8 Mb", "1Tb", "512Kb"])
def test_a_unit_of_bits_is_refused_not_read_as_bytes(text):
    """``Gb`` is gigabits: it used to be read as gigabytes. ``8 gb`` (all lower case) stays gigabytes."""
    with pytest.raises(ValueError, match=r"is a unit of bits, not bytes. Write .B \(powers of 1000\) or .iB"):
        parse_bytes(text)



@pytest.mark.parametrize("value", ["1.5", 1.5, "2.5 B", "100.5"])
def test_a_fraction_of_a_byte_is_a_missing_unit_not_a_size(value):
    """``budget="1.5"`` was read as 1 byte (then "available 0 B" from the probe): a number without a unit counts
    bytes, and a fraction of one is a unit left out; the message names the value and the units to write."""
    with pytest.raises(ValueError, match=r"not a whole number of bytes.*'[\d.]+GiB'"):
        parse_bytes(value)


def test_negative_control_fractions_that_make_whole_bytes_are_sizes():
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes("0.5kB") == 500 and parse_bytes(2.0) == 2
    assert parse_bytes("1.4MiB") == int(1.4 * 2**20)  # a unit given: rounded down to whole bytes
