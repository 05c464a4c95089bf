"""Input checks shared by the accounting functions.

Each check returns the problems it found as sentences; :func:`require` raises them together as one
ValueError, before any arithmetic, so a caller learns everything to change at once. What makes a
parallel layout impossible for a model (more pipeline stages than layers, a tensor-parallel degree
that does not split the heads) is decided here, in :func:`parallel_layout`, and nowhere else.
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


def nonnegative(**values) -> list[str]:
    """Real numbers >= 0 (latencies)."""
    return [
        f"{name} must be a number >= 0, got {value!r}"
        for name, value in values.items()
        if isinstance(value, bool) or not isinstance(value, Real) or value < 0
    ]


def positive_int(**values) -> list[str]:
    """Integers >= 1 (device counts, parallel degrees, sequence lengths)."""
    return [
        f"{name} must be an integer >= 1, got {value!r}"
        for name, value in values.items()
        if isinstance(value, bool) or not isinstance(value, int) or value < 1
    ]


def boolean(**values) -> list[str]:
    """True or False, not a number that compares equal to one (``1 == True``)."""
    return [
        f"{name} must be True or False, got {value!r}" for name, value in values.items() if not isinstance(value, bool)
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parallel_layout(model, *, dp: int = 1, tp: int = 1, pp: int = 1, sp: bool = False, seq_len=None) -> list[str]:
    """What cannot work in splitting ``model`` over ``dp x tp x pp`` devices (empty when it can).

    Every degree is an integer >= 1. For a ModelConfig (a bare parameter count has no layers or heads):
    each of the ``pp`` pipeline stages needs at least one layer; tensor parallelism gives each of its
    ``tp`` ranks whole attention heads, so ``tp`` divides the query heads and the key/value heads; and
    with sequence parallelism (``sp``) it splits ``seq_len`` into ``tp`` equal shards.
    """
    problems = positive_int(dp=dp, tp=tp, pp=pp)
    if problems or not isinstance(model, ModelConfig):
        return problems
    name, layers, heads, kv_heads = model.name, model.n_layers, model.n_heads, model.n_kv_heads
    if pp > layers:
        problems.append(f"pp ({pp}) must be at most the number of layers ({layers}) of {name}: every pipeline "
                        f"stage holds at least one layer; choose pp from 1 to {layers}")  # fmt: skip
    if heads % tp:
        problems.append(f"tp ({tp}) must divide n_heads ({heads}) of {name}; choose tp from {_divisors(heads)}")
    elif kv_heads % tp:
        problems.append(f"tp ({tp}) must divide n_kv_heads ({kv_heads}) of {name}, whose key/value heads it "
                        f"splits; choose tp from {_divisors(kv_heads)}")  # fmt: skip
    if sp and isinstance(seq_len, int) and seq_len > 0 and seq_len % tp:
        problems.append(f"sequence parallelism splits the sequence over tp ranks: seq_len ({seq_len}) must be "
                        f"divisible by tp ({tp})")  # fmt: skip
    return problems


def even_split(model: ModelConfig, *, tp: int = 1, pp: int = 1) -> list[str]:
    """Beyond :func:`parallel_layout`, what an exact per-rank count needs: ``pp`` divides the layers (equal
    stages), and ``tp`` divides the MLP width and the vocabulary (every rank an equal slice, no padding)."""
    problems = []
    if model.n_layers % pp:
        problems.append(f"pp ({pp}) must divide n_layers ({model.n_layers}) of {model.name} for equal stages")
    for name, size in (("d_ff", model.d_ff), ("vocab_size", model.vocab_size)):
        if size % tp:
            problems.append(f"tp ({tp}) must divide {name} ({size}) of {model.name}; pad it to "
                            f"{-(-size // tp) * tp}")  # fmt: skip
    return problems
