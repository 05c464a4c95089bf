"""scalebook.accounting refuses what it cannot compute: one ValueError, before any arithmetic, that says what to change.

The rules that make a parallel layout impossible for a model (more pipeline stages than layers, a tensor-parallel
degree that does not split the query or key/value heads, a sequence that sequence parallelism cannot split) live in
one function, ``accounting._checks.parallel_layout``; every accounting function that takes a layout asks it.
"""

from pathlib import Path

import pytest

from scalebook import accounting, configs, widgets
from scalebook.accounting import _checks

CFG = configs.get_model("gpt3-175b")
BAD_INPUTS = [
    (lambda: accounting.model_state_bytes(1e9, zero_stage=4), "zero_stage must be one of (0, 1, 2, 3)"),
    (lambda: accounting.model_state_bytes(1e9, zero_stage=1, dp=0), "dp must be an integer >= 1"),
    (lambda: accounting.model_state_bytes(1e9, tp=0), "tp must be an integer >= 1"),
    (lambda: accounting.model_state_bytes(1e9, pp=-1), "pp must be an integer >= 1"),
    (lambda: accounting.model_state_bytes(1e9, precision="fp16"),
     "precision must be one of ('fp32', 'mixed', 'mixed-fp32-grads')"),
    (lambda: accounting.model_state_bytes(1e9, optimizer="adamw"),
     "optimizer must be one of ('adam', 'sgd', 'sgd-momentum')"),
    (lambda: accounting.model_state_bytes(-5), "model must be a ModelConfig or a positive parameter count"),
    (lambda: accounting.activation_bytes(CFG, seq_len=2048, micro_batch=1, recompute="some"),
     "recompute must be one of ('none', 'selective', 'full')"),
    (lambda: accounting.activation_bytes(CFG, seq_len=0, micro_batch=1), "seq_len must be an integer >= 1"),
    (lambda: accounting.activation_bytes(CFG, seq_len=2048, micro_batch=0),
     "micro_batch must be an integer >= 1"),
    (lambda: accounting.activation_bytes(CFG, seq_len=2048, micro_batch=1, tp=5),
     "tp (5) must divide n_heads (96) of gpt3-175b; "
     "choose tp from [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]"),
    (lambda: accounting.activation_bytes(CFG, seq_len=2050, micro_batch=1, tp=8, sp=True),
     "seq_len (2050) must be divisible by tp (8)"),
    (lambda: accounting.activation_bytes(CFG, seq_len=2048, micro_batch=1, sp="yes"), "sp must be one of"),
    (lambda: accounting.activation_bytes(175e9, seq_len=2048, micro_batch=1), "expected a ModelConfig"),
    (lambda: accounting.param_count("gpt2"),
     "expected a ModelConfig (e.g. scalebook.configs.get_model('gpt2'))"),
    (lambda: accounting.param_count_closed_form(None), "expected a ModelConfig"),
    (lambda: accounting.training_flops(CFG, 0), "tokens must be a positive number"),
    (lambda: accounting.training_flops_with_attention(CFG, 1e9, seq_len=0),
     "seq_len must be an integer >= 1"),
    (lambda: accounting.flops_per_token(175e9, seq_len=2048), "expected a ModelConfig"),
    (lambda: accounting.flops_per_token(CFG, recompute="full"), "recompute must be one of (False, True)"),
    (lambda: accounting.mfu(CFG, 1e6, 0, 1e15), "n_devices must be an integer >= 1"),
    (lambda: accounting.mfu(CFG, -1, 8, 1e15), "tokens_per_second must be a positive number"),
    (lambda: accounting.training_days(CFG, 1e12, 8, 1e15, 1.5), "mfu is a fraction of peak, at most 1"),
    (lambda: accounting.training_days(CFG, 1e12, 8, 1e15, 0), "mfu must be a positive number"),
    (lambda: accounting.training_days(CFG, 1e12, 8, -1e15, 0.4), "peak_flops must be a positive number"),
    (lambda: accounting.devices_needed(CFG, 1e12, 0, 1e15, 0.4), "days must be a positive number"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "message"), BAD_INPUTS)
def test_bad_input_raises_one_value_error_that_says_what_to_change(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value)


def test_every_problem_is_reported_in_the_same_error():
    with pytest.raises(ValueError) as error:
        accounting.model_state_bytes(1e9, zero_stage=5, dp=0, precision="fp8")
    assert all(word in str(error.value) for word in ("zero_stage", "dp", "precision"))


def test_tensor_parallelism_must_split_the_key_value_heads():
    with pytest.raises(ValueError, match=r"tp \(16\) must divide n_kv_heads \(8\)"):
        accounting.activation_bytes(configs.get_model("llama-3-8b"), seq_len=8192, micro_batch=1, tp=16)


LLAMA_70B = configs.get_model("llama-3-70b")  # 80 layers, 64 query heads, 8 key/value heads
IMPOSSIBLE_LAYOUTS = [
    (dict(pp=81), "pp (81) must be at most the number of layers (80) of llama-3-70b: every pipeline stage holds "
                  "at least one layer; choose pp from 1 to 80"),
    (dict(pp=1024), "pp (1024) must be at most the number of layers (80)"),
    (dict(tp=3), "tp (3) must divide n_heads (64) of llama-3-70b; choose tp from [1, 2, 4, 8, 16, 32, 64]"),
    (dict(tp=16), "tp (16) must divide n_kv_heads (8) of llama-3-70b, whose key/value heads it splits; "
                  "choose tp from [1, 2, 4, 8]"),
    (dict(dp=0), "dp must be an integer >= 1, got 0"),
    (dict(tp=-2), "tp must be an integer >= 1, got -2"),
    (dict(pp=2.0), "pp must be an integer >= 1, got 2.0"),
    (dict(zero_stage=4), "zero_stage must be one of (0, 1, 2, 3), got 4"),
    (dict(zero_stage=-1), "zero_stage must be one of (0, 1, 2, 3), got -1"),
]  # fmt: skip


@pytest.mark.parametrize(("layout", "message"), IMPOSSIBLE_LAYOUTS)
def test_an_impossible_layout_is_refused_with_what_to_change(layout, message):
    with pytest.raises(ValueError) as error:
        accounting.model_state_bytes(LLAMA_70B, **layout)
    assert message in str(error.value)
    # The memory calculator refuses it with the same words (the form's fields are named as in the package).
    form = {key: str(value) for key, value in widgets.memory_calculator_inputs("llama-3-70b").defaults.items()}
    if all(str(value) in map(str, widgets.memory_calculator_inputs().controls[key].options) or key == "zero_stage"
           for key, value in layout.items()) and "must be one of" not in message:  # fmt: skip
        shown = widgets.calculator_html("memory", form | {key: str(value) for key, value in layout.items()})
        assert shown.startswith("<b>Not a valid layout:</b>") and message.replace("'", "&#x27;") in shown


def test_more_pipeline_stages_than_layers_is_refused_not_counted_as_less_memory():
    # The case: Llama 3 70B on pp = 1024 reported 0.0 GB of model states (16 bytes x 70.6e9 / 1024 / 64).
    one_layer_per_stage = accounting.model_state_bytes(LLAMA_70B, pp=80, tp=8, zero_stage=3, dp=64)
    assert one_layer_per_stage.params == -(-accounting.model_state_bytes(LLAMA_70B).params // (80 * 8 * 64))
    with pytest.raises(ValueError, match=r"pp \(1024\) must be at most the number of layers \(80\)"):
        accounting.model_state_bytes(LLAMA_70B, pp=1024, tp=8, zero_stage=3, dp=64)
    with pytest.raises(ValueError, match=r"pp \(1024\) must be at most the number of layers \(80\)"):
        widgets.memory_per_gpu("llama-3-70b", pp=1024)
    # A bare parameter count has no layers to check: the formula divides it by pp as asked.
    assert accounting.model_state_bytes(70e9, pp=1024).total == -(-16 * 70e9 // 1024)


def test_every_layout_problem_comes_in_one_error_before_any_arithmetic():
    with pytest.raises(ValueError) as error:
        accounting.model_state_bytes(LLAMA_70B, tp=3, pp=100, zero_stage=7)
    message = str(error.value)
    assert "zero_stage must be one of" in message and "tp (3) must divide" in message and "pp (100)" in message
    with pytest.raises(ValueError) as error:
        accounting.activation_bytes(LLAMA_70B, seq_len=100, micro_batch=1, tp=8, sp=True, recompute="some")
    assert "seq_len (100) must be divisible by tp (8)" in str(error.value) and "recompute must be" in str(error.value)


def test_the_layout_rules_live_in_checks_and_nowhere_else_in_accounting():
    package = Path(_checks.__file__).parent
    phrases = ('f"tp ({', 'f"pp ({', "number of layers", "whose key/value heads")  # the sentences of the rules
    elsewhere = {
        (path.name, phrase)
        for path in package.glob("*.py") if path.name != "_checks.py"
        for phrase in phrases if phrase in path.read_text(encoding="utf8")
    }  # fmt: skip
    assert elsewhere == set()
    assert _checks.parallel_layout(LLAMA_70B, dp=8, tp=8, pp=80, sp=True, seq_len=8192) == []
