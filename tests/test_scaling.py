"""Scaling laws (scalebook.scaling): the closed-form compute-optimal split against a brute-force minimum, the
published exponents and Chinchilla's size, and the IsoFLOP fit against data drawn from a known law."""

import math

import pytest

from scalebook.scaling import BESIROGLU_2024, HOFFMANN_2022, ParametricLaw, fit_power_law, isoflop_minimum

GOPHER_FLOPS = 5.76e23  # Hoffmann et al. 2022: Gopher's budget, which Chinchilla was trained with


@pytest.mark.parametrize("law", [HOFFMANN_2022, BESIROGLU_2024], ids=["hoffmann", "besiroglu"])
def test_closed_form_optimum_is_the_minimum_along_the_budget(law):
    """Eq. 4's N_opt equals the size that a scan over N finds, spending D = C / (6N) at each N."""
    grid = [1e9 * 10 ** (k / 2000) for k in range(6001)]  # 1B to 1T parameters, steps of 0.115 %
    scanned = min(grid, key=lambda n: law.loss(n, GOPHER_FLOPS / (6 * n)))
    params, tokens = law.compute_optimal(GOPHER_FLOPS)
    assert abs(params / scanned - 1) < 0.0012  # within one grid step
    assert math.isclose(6 * params * tokens, GOPHER_FLOPS)


def test_published_params_exponents():
    """a = beta / (alpha + beta) as the papers print it: 0.46 for Hoffmann et al.'s Approach 3 (Table 2), 0.5126
    for Besiroglu et al.'s refit. Hoffmann's alpha = 0.34 and beta = 0.28 are printed to two digits (the 0.46 comes
    from their unrounded fit): rounding each by up to 0.005 moves a by up to 0.008, hence 0.01. Besiroglu's four
    digits move a by under 1e-4."""
    assert abs(HOFFMANN_2022.params_exponent - 0.46) < 0.01
    assert abs(BESIROGLU_2024.params_exponent - 0.5126) < 1e-4


def test_refit_gives_chinchilla_and_the_printed_constants_do_not():
    """At Gopher's budget the refit puts the optimum at Chinchilla's 70B parameters and 1.4T tokens, about 20 tokens
    per parameter; 10 % admits Chinchilla's round 70B (Hoffmann et al.'s Approach 1 gives 67B for this budget,
    Table 3). The constants as printed in Hoffmann et al. give a much smaller model on far more tokens: the
    inconsistency Besiroglu et al. point out."""
    params, tokens = BESIROGLU_2024.compute_optimal(GOPHER_FLOPS)
    assert abs(params / 70e9 - 1) < 0.10 and abs(tokens / 1.4e12 - 1) < 0.10
    assert 15 < BESIROGLU_2024.tokens_per_parameter(GOPHER_FLOPS) < 25
    printed_params, _ = HOFFMANN_2022.compute_optimal(GOPHER_FLOPS)
    assert printed_params < 0.5 * 70e9 and HOFFMANN_2022.tokens_per_parameter(GOPHER_FLOPS) > 50
    assert abs(6 * 70e9 * 1.4e12 / GOPHER_FLOPS - 1) < 0.03  # Chinchilla spent Gopher's budget (6ND, rounded sizes)


@pytest.mark.parametrize("law", [HOFFMANN_2022, BESIROGLU_2024], ids=["a=0.45", "a=0.51"])
def test_isoflop_fit_recovers_the_exponent_of_a_known_law(law):
    """Approach 2 on noise-free losses from a known L(N, D): seven sizes spaced by a factor 2 around each budget's
    true optimum, a parabola per budget, a power law across budgets. The true exponent comes from the constants
    (not from the fitting code). The parabola in ln N is an approximation of a curve that is not one, whose
    vertex shifts by the same factor at every budget when the sizes sit the same way around the optimum: each
    vertex is 1 to 4 % off (measured), within the 10 % asserted, and the exponent is recovered to 0.005 (measured:
    1e-13)."""
    true_a = law.beta / (law.alpha + law.beta)
    budgets = [1e18, 1e19, 1e20, 1e21, 1e22]
    optima = []
    for c in budgets:
        centre = law.compute_optimal(c)[0]
        sizes = [centre * 2.0**k for k in range(-3, 4)]
        n_opt, (c2, _, _) = isoflop_minimum(sizes, [law.loss(n, c / (6 * n)) for n in sizes])
        assert c2 > 0 and abs(n_opt / centre - 1) < 0.10
        optima.append(n_opt)
    a, _ = fit_power_law(budgets, optima)
    assert abs(a - true_a) < 0.005


def test_fit_power_law_recovers_exponent_and_coefficient():
    a, k = fit_power_law([1.0, 10.0, 100.0], [3.0, 3.0 * 10**0.7, 3.0 * 100**0.7])
    assert math.isclose(a, 0.7, rel_tol=1e-9) and math.isclose(k, 3.0, rel_tol=1e-9)


def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="does not curve upwards"):
        isoflop_minimum([1e3, 2e3, 4e3], [3.0, 2.9, 2.8])  # loss still falling: the optimum lies beyond the sizes
    with pytest.raises(ValueError, match="three or more"):
        isoflop_minimum([1e3, 2e3], [3.0, 2.9])
    with pytest.raises(ValueError, match="alpha"):
        ParametricLaw(E=1.0, A=1.0, B=1.0, alpha=0.0, beta=0.3)
    with pytest.raises(ValueError, match="positive"):
        BESIROGLU_2024.compute_optimal(-1.0)


def test_ladder_is_deterministic_and_spends_its_budget():
    """Two runs of a small ladder give the same losses to the bit (seeded weights and batches, one thread); each run
    spends its budget up to rounding its steps to a whole number (at most half a step's FLOPs); the caller's thread
    count is restored."""
    import torch

    from scalebook import data
    from scalebook.experiments.scaling import isoflop_ladder

    train_tokens, val_tokens = data.train_val_split(data.tokenize(data.default_corpus()[:50_000]), val_fraction=0.1)
    threads = torch.get_num_threads()
    plan = {3e7: (4, 8, 12)}
    first, second = (isoflop_ladder(train_tokens, val_tokens, plan, seq_len=32) for _ in range(2))
    assert [run.val_loss for run in first] == [run.val_loss for run in second]
    assert all(abs(run.flops / run.budget - 1) <= 0.5 / run.steps for run in first)
    assert torch.get_num_threads() == threads
