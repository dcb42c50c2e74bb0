"""ckpt.units: one size convention for every tool and the trainer (decimal SI, one decimal)."""

from ckpt.units import human_bytes


def test_sizes_print_in_decimal_units():
    assert human_bytes(999) == "999 B" and human_bytes(1234567) == "1.2 MB"
    assert human_bytes(10_400_000) == "10.4 MB" and human_bytes(3_000_000) == "3.0 MB"
    assert human_bytes(999_960) == "1.0 MB"  # rounds up into the next unit, never "1000.0 kB"
    assert human_bytes(None) == "-" and human_bytes(5 * 10**18) == "5000.0 PB"
