"""Chapter 1's hardware and history numbers: growth of GPUs from scalebook.configs, and what a 70B model needs."""

import math

import matplotlib
import pytest

from scalebook import accounting, configs
from scalebook.plots.hardware import hardware_growth, hardware_numbers

matplotlib.use("Agg")

LINE = ["p100-sxm2-16gb", "v100-sxm2-16gb", "a100-sxm4-80gb", "h100-sxm", "h200", "b200"]


def test_hardware_numbers_read_the_16_bit_peak_hbm_and_link():
    p100, h100 = configs.get_hardware("p100-sxm2-16gb"), configs.get_hardware("h100-sxm")
    assert hardware_numbers(p100) == {
        "16-bit peak FLOP/s": 21.2e12,  # fp16: the P100 has no bf16
        "HBM capacity": 16e9,
        "HBM bandwidth": 732e9,
        "GPU-to-GPU link (NVLink)": 80e9,
    }
    assert hardware_numbers(h100)["16-bit peak FLOP/s"] == h100.peak("bf16")


def test_compute_grew_about_ten_times_faster_than_memory_and_links():
    first, last = (hardware_numbers(configs.get_hardware(name)) for name in (LINE[0], LINE[-1]))
    growth = {what: last[what] / first[what] for what in first}
    assert growth["16-bit peak FLOP/s"] == pytest.approx(2250e12 / 21.2e12)  # about 106x
    assert all(8 < g < 12 for what, g in growth.items() if what != "16-bit peak FLOP/s")


def test_growth_figure_has_one_line_per_quantity_starting_at_one():
    fig = hardware_growth([configs.get_hardware(name) for name in LINE])
    lines = fig.axes[0].get_lines()
    assert len(lines) == 4
    assert all(line.get_ydata()[0] == 1 for line in lines)
    assert list(lines[0].get_xdata()) == [2016, 2017, 2020, 2022, 2024, 2025]


def test_growth_needs_two_gpus_with_years():
    with pytest.raises(ValueError, match="at least two GPUs"):
        hardware_growth([configs.get_hardware("h100-sxm")])


def test_70b_needs_1120_gb_of_model_states_and_14_h100s():
    # The Ultra-Scale Playbook's "~1,120 GB, at least 14 H100s" for a 70B model in mixed precision with Adam.
    held = accounting.model_state_bytes(70e9, precision="mixed", optimizer="adam").total
    assert held == 1120e9
    assert math.ceil(held / configs.get_hardware("h100-sxm").hbm_bytes) == 14
