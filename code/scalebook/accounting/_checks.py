"""Input checks shared by the accounting functions.

Each check returns the problems it found as sentences; :func:`require` raises them together as one
ValueError, before any arithmetic, so a caller learns everything to change at once.
"""

from __future__ import annotations

from numbers import Real

from scalebook.configs import ModelConfig


def require(*problem_lists: list[str]) -> None:
    problems = [problem for problems in problem_lists for problem in problems]
    if problems:
        raise ValueError("; ".join(problems))


def positive(**values) -> list[str]:
    """Real numbers > 0 (token counts, FLOP/s, days)."""
    return [
        f"{name} must be a positive number, got {value!r}"
        for name, value in values.items()
        if isinstance(value, bool) or not isinstance(value, Real) or not value > 0
    ]


def positive_int(**values) -> list[str]:
    """Integers >= 1 (device counts, parallel degrees, sequence lengths)."""
    return [
        f"{name} must be an integer >= 1, got {value!r}"
        for name, value in values.items()
        if isinstance(value, bool) or not isinstance(value, int) or value < 1
    ]


def one_of(name: str, value, choices: tuple) -> list[str]:
    return [] if value in choices else [f"{name} must be one of {choices}, got {value!r}"]


def model_config(cfg) -> list[str]:
    if isinstance(cfg, ModelConfig):
        return []
    return [f"expected a ModelConfig (e.g. scalebook.configs.get_model('gpt2')), got {type(cfg).__name__}"]


def model_or_count(model) -> list[str]:
    """A ModelConfig, or a parameter count N given directly (``175e9``)."""
    if isinstance(model, ModelConfig):
        return []
    if isinstance(model, bool) or not isinstance(model, Real) or not model > 0:
        return [f"model must be a ModelConfig or a positive parameter count, got {model!r}"]
    return []
