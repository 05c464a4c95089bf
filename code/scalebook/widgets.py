"""Interactive calculators and explorers for the chapters, built with ipywidgets.

Each widget is thin: the numbers come from the package (``accounting``, the models), the widget only
lets the reader move the inputs. A widget needs a running kernel, so every chapter that shows one also
shows a static figure of the same thing.

The three calculators (memory per GPU, training time, layout planner) are each one :class:`Calculator`:
its inputs and one function from their values to HTML. The ipywidgets panel (JupyterLab) and the live
calculator of the built book (book/_ext/live_calculators.py, which runs this module in the reader's
browser with Pyodide) are both thin over it, so the two cannot disagree. This module imports neither
torch nor ipywidgets at import time.

Source: ipywidgets documentation, "Using Interact" and "Output widgets".
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from scalebook import accounting, configs
from scalebook.configs import ModelConfig

# ------------------------------------------------------------------------------------------ calculator panels


@dataclass(frozen=True)
class Control:
    """One input of a calculator: a choice among ``options``, a checkbox (a bool default) or a number.

    A number's range is the form's: ``above`` (exclusive) or ``minimum``, and ``maximum``, in the units of the
    label, which ``unit`` repeats after a value that a message quotes ("got 150 %"). The calculator checks its
    inputs against them before it calls the package, so that a reader's mistake is told in the form's words (the
    label, the unit, the number typed), not in the package's (``mfu``, a fraction, ``1.5``).
    """

    label: str
    default: object
    options: tuple = ()
    above: float | None = None
    minimum: float | None = None
    maximum: float | None = None
    unit: str = ""

    @property
    def kind(self) -> str:
        if isinstance(self.default, bool):
            return "checkbox"
        return "choice" if self.options else "number"

    def echo(self, value) -> str:
        """``value`` as the form shows it, with the unit: ``150 %``, ``-5 billion``, ``0``."""
        text = f"{value:g}" if isinstance(value, float) else str(value)
        return f"{text} {self.unit}" if self.unit else text

    def parse(self, text: str):
        """The value that a web form's text for this input stands for (a form sends every value as text)."""
        if self.kind == "checkbox":
            return text == "true"
        if self.kind == "choice":
            for option in self.options:
                if str(option) == text:
                    return option
            raise ValueError(f"{self.label} must be one of {', '.join(map(str, self.options))}, got {text}")
        number = type(self.default)
        what = "a whole number" if number is int else "a number"
        if not text.strip():  # a number field sends "" when it is empty or holds something that is not a number
            raise ValueError(f"{self.label} needs {what}: the field is empty or holds something that is not a number")
        try:
            value = number(text)
        except ValueError:
            raise ValueError(f"{self.label} must be {what}, got {text.strip()}") from None
        if not math.isfinite(value):
            raise ValueError(f"{self.label} must be a finite number, got {text.strip()}")
        return value

    def problem(self, value) -> str | None:
        """What is wrong with ``value`` for this input's range, in the form's words (None when nothing is)."""
        if self.kind != "number":
            return None
        if self.above is not None and not value > self.above:
            return f"{self.label} must be more than {self.above:g}, got {self.echo(value)}"
        if self.minimum is not None and not value >= self.minimum:
            return f"{self.label} must be at least {self.minimum:g}, got {self.echo(value)}"
        if self.maximum is not None and not value <= self.maximum:
            return f"{self.label} must be at most {self.maximum:g}, got {self.echo(value)}"
        return None

    def widget(self):
        """The ipywidgets control for this input."""
        import ipywidgets as w

        common = dict(description=self.label, value=self.default, style={"description_width": "110px"},
                      layout=w.Layout(width="240px"))  # fmt: skip
        if self.kind == "checkbox":
            return w.Checkbox(**common)
        if self.kind == "choice":
            return w.Dropdown(options=self.options, **common)
        return (w.IntText if isinstance(self.default, int) else w.FloatText)(**common)


@dataclass(frozen=True)
class Calculator:
    """A calculator: named inputs, the function from their values to HTML, and how its errors are titled.

    ``render`` raises ValueError for an input it cannot compute (a layout the formulas reject); the
    calculator shows that message instead of a result.
    """

    controls: dict[str, Control]
    render: Callable[..., str]
    error_title: str

    @property
    def defaults(self) -> dict[str, object]:
        return {name: control.default for name, control in self.controls.items()}

    def html(self, **values) -> str:
        """The result for these input values; or what is wrong with them, out of each input's range in the
        form's words, else as the package's ValueError says it."""
        problems = [problem for name, control in self.controls.items()
                    if name in values and (problem := control.problem(values[name]))]  # fmt: skip
        try:
            if problems:
                raise ValueError("; ".join(problems))
            return self.render(**values)
        except ValueError as error:
            return self._error_html(error)

    def html_from_form(self, form: Mapping[str, str]) -> str:
        """:meth:`html` for a web form's text values (every input named, as :meth:`Control.parse` reads it)."""
        missing = [name for name in self.controls if name not in form]
        try:
            if missing:
                raise ValueError(f"the form has no input named {', '.join(missing)}")
            values = {name: control.parse(form[name]) for name, control in self.controls.items()}
        except ValueError as error:
            return self._error_html(error)
        return self.html(**values)

    def _error_html(self, error: ValueError) -> str:
        return f"<b>{html.escape(self.error_title)}:</b> {html.escape(str(error))}"

    def panel(self, columns: int = 3):
        """The ipywidgets panel: a grid of the controls over the result, recomputed on every change."""
        import ipywidgets as w

        controls = {name: control.widget() for name, control in self.controls.items()}
        result = w.HTML()

        def update(_change=None) -> None:
            result.value = self.html(**{name: control.value for name, control in controls.items()})

        for control in controls.values():
            control.observe(update, names="value")
        update()
        grid = w.GridBox(list(controls.values()), layout=w.Layout(grid_template_columns=f"repeat({columns}, 250px)"))
        return w.VBox([grid, result])


# ------------------------------------------------------------------------------------------ memory calculator


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes the busiest GPU holds to train a model in one layout, against that GPU's memory."""

    model: str
    gpu: str
    rows: tuple[tuple[str, int], ...]  # (what, bytes): parameters, gradients, optimizer states, activations
    capacity: int  # the GPU's HBM in bytes

    @property
    def total(self) -> int:
        return sum(nbytes for _, nbytes in self.rows)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def memory_per_gpu(
    model: str | ModelConfig = "gpt3-175b",
    *,
    seq_len: int = 2048,
    micro_batch: int = 1,
    precision: str = "mixed",
    zero_stage: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    sp: bool = False,
    recompute: str = "none",
    attention: str = "auto",
    gpu: str = "h100-sxm",
) -> MemoryEstimate:
    """Model states plus activations on one GPU: ``accounting.model_state_bytes`` + ``activation_bytes``.

    Adam; activations are 16-bit unless ``precision="fp32"``; GPT-layout models keep Korthikanti et
    al.'s dropout masks, Llama-layout models train without dropout; ``attention="fused"`` stores no
    attention scores (FlashAttention), ``"explicit"`` stores them; ``"auto"`` (the default) takes what the
    model was trained with: explicit for GPT-layout models (GPT-2, GPT-3 and Megatron-LM's GPTs), fused for
    the others (Llama, Mixtral, DeepSeek). Pipeline parallelism divides the
    model states by ``pp`` but not the activations: under 1F1B the first stage holds L/pp layers for pp
    micro-batches in flight, as many bytes as all L layers of one micro-batch. Not counted: the logits
    and the loss, temporary buffers, and the allocator's fragmentation.
    """
    cfg = configs.get_model(model) if isinstance(model, str) else model
    device = configs.get_hardware(gpu)
    if attention == "auto":
        attention = "explicit" if cfg.arch == "gpt" else "fused"
    states = accounting.model_state_bytes(
        cfg, zero_stage=zero_stage, dp=dp, tp=tp, pp=pp, precision=precision, optimizer="adam"
    )
    activations = accounting.activation_bytes(
        cfg, seq_len=seq_len, micro_batch=micro_batch, tp=tp, sp=sp, recompute=recompute, attention=attention,
        dtype_bytes=4 if precision == "fp32" else 2, dropout=cfg.arch == "gpt",
    )  # fmt: skip
    rows = (
        ("parameters", states.params),
        ("gradients", states.grads),
        ("optimizer states", states.optimizer),
        ("activations", activations),
    )
    return MemoryEstimate(model=cfg.name, gpu=device.name, rows=rows, capacity=device.hbm_bytes)


_ROW_COLORS = {"parameters": "#1f77b4", "gradients": "#ff7f0e", "optimizer states": "#2ca02c",
               "activations": "#d62728"}  # fmt: skip


def memory_estimate_html(estimate: MemoryEstimate) -> str:
    """The estimate as an HTML table and a bar of the GPU's memory, filled by each kind of bytes."""
    gb = 1e9
    scale = max(estimate.total, estimate.capacity)
    segments = "".join(
        f'<div title="{what}" style="width:{100 * nbytes / scale:.2f}%;background:{_ROW_COLORS[what]}"></div>'
        for what, nbytes in estimate.rows
    )
    marker = 100 * estimate.capacity / scale
    bar = (
        '<div style="position:relative;display:flex;height:18px;width:100%;background:#eee;margin:6px 0">'
        f"{segments}"
        f'<div style="position:absolute;left:{marker:.2f}%;top:-4px;bottom:-4px;'
        'border-left:2px dashed currentColor"></div></div>'
    )
    rows = "".join(
        f'<tr><td><span style="color:{_ROW_COLORS[what]}">&#9632;</span> {what}</td>'
        f'<td style="text-align:right">{nbytes / gb:,.1f} GB</td></tr>'
        for what, nbytes in estimate.rows
    )
    verdict = (
        f"fits: {estimate.total / estimate.capacity:.0%} of the {estimate.capacity / gb:.0f} GB"
        if estimate.fits
        else f"does not fit: {estimate.total / estimate.capacity:.1f} x the {estimate.capacity / gb:.0f} GB"
    )
    return (
        f"<b>{html.escape(estimate.model)} on {html.escape(estimate.gpu)}</b>, per GPU"
        f'<table style="margin:4px 0">{rows}<tr><td><b>total</b></td>'
        f'<td style="text-align:right"><b>{estimate.total / gb:,.1f} GB</b></td></tr></table>'
        f"{bar}<span>{verdict} (dashed line)</span>"
    )


_DEGREES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def memory_calculator_inputs(model: str = "gpt3-175b", gpu: str = "h100-sxm") -> Calculator:
    """The memory calculator: model, GPU, precision, sequence and layout in, :func:`memory_per_gpu` out."""
    controls = {
        "model": Control("model", model, tuple(configs.list_models())),
        "gpu": Control("GPU", gpu, tuple(configs.list_hardware())),
        "precision": Control("precision", "mixed", accounting.PRECISIONS),
        "seq_len": Control("sequence", 2048, tuple(2**k for k in range(9, 18))),
        "micro_batch": Control("micro-batch", 1, (1, 2, 4, 8, 16, 32)),
        "recompute": Control("recompute", "none", accounting.RECOMPUTE),
        "attention": Control("attention", "auto", ("auto", *accounting.ATTENTION)),
        "zero_stage": Control("ZeRO stage", 0, accounting.ZERO_STAGES),
        "dp": Control("dp", 1, _DEGREES),
        "tp": Control("tp", 1, _DEGREES[:8]),
        "pp": Control("pp", 1, _DEGREES),
        "sp": Control("sequence parallel", False),
    }
    return Calculator(controls, lambda **values: memory_estimate_html(memory_per_gpu(**values)), "Not a valid layout")


def memory_calculator(model: str = "gpt3-175b", gpu: str = "h100-sxm"):
    """Pick a model, a sequence, a precision and a parallel layout; read the bytes each GPU holds.

    A thin panel over :func:`memory_per_gpu`: every change recomputes the estimate, and a layout the
    formulas reject (tp not dividing the heads, say) shows the error instead.
    """
    return memory_calculator_inputs(model, gpu).panel()


# ------------------------------------------------------------------------------------ training time calculator


def training_time_html(
    model: str, gpu: str, dtype: str, seq_len: int, tokens_billions: float, gpus: int, mfu_percent: float,
    deadline_days: float,
) -> str:  # fmt: skip
    """Days to train ``model`` on ``gpus`` GPUs, and the GPUs a deadline needs, as HTML.

    ``accounting.training_days`` and ``accounting.devices_needed`` with the attention-aware FLOPs per token
    at ``seq_len``, at ``mfu_percent`` of the GPU's dense peak in ``dtype``; no recomputation.
    """
    cfg, device = configs.get_model(model), configs.get_hardware(gpu)
    if dtype not in device.peak_flops:  # said in the form's words: the "peak dtype" input, the GPU's name
        raise ValueError(f"peak dtype {dtype} is not one that the {gpu} has a peak for; choose one of "
                         f"{', '.join(device.peak_flops)}")  # fmt: skip
    peak = device.peak(dtype)
    tokens, mfu = tokens_billions * 1e9, mfu_percent / 100
    days = accounting.training_days(cfg, tokens, gpus, peak, mfu, seq_len=seq_len)
    needed = accounting.devices_needed(cfg, tokens, deadline_days, peak, mfu, seq_len=seq_len)
    flops = tokens * accounting.flops_per_token(cfg, seq_len=seq_len)
    return (
        f"<b>{html.escape(cfg.name)}</b>, {tokens_billions:,g}B tokens of {seq_len:,}: {flops:.3g} FLOPs.<br>"
        f"On {gpus:,} {html.escape(gpu)} at {mfu_percent:g} % of the {peak / 1e12:,.0f} TFLOP/s {dtype} peak: "
        f"<b>{_duration(days)}</b>.<br>Within {deadline_days:,g} days: "
        f"<b>{needed:,} GPU{'' if needed == 1 else 's'}</b>."
    )


def _duration(days: float) -> str:
    """``days`` as days, or as hours or minutes when under one (a small model's run does not read as "0.0 days")."""
    if days >= 1:
        return f"{days:,.1f} days"
    return f"{days * 24:.1f} hours" if days * 24 >= 1 else f"{days * 24 * 60:.1f} minutes"


def training_time_inputs(model: str = "gpt3-175b", gpu: str = "a100-sxm4-80gb") -> Calculator:
    """The training time calculator: model, tokens, GPUs and MFU in, :func:`training_time_html` out."""
    controls = {
        "model": Control("model", model, tuple(configs.list_models())),
        "gpu": Control("GPU", gpu, tuple(configs.list_hardware())),
        "dtype": Control("peak dtype", "bf16", ("fp32", "tf32", "bf16", "fp16", "fp8")),
        "seq_len": Control("sequence", 2048, tuple(2**k for k in range(9, 18))),
        "tokens_billions": Control("tokens (billions)", 300.0, above=0, unit="billion"),
        "gpus": Control("GPUs", 1024, minimum=1),
        "mfu_percent": Control("MFU (%)", 40.0, above=0, maximum=100, unit="%"),
        "deadline_days": Control("deadline (days)", 30.0, above=0, unit="days"),
    }
    return Calculator(controls, training_time_html, "Cannot estimate")


def training_time_calculator(model: str = "gpt3-175b", gpu: str = "a100-sxm4-80gb"):
    """Pick a model, a token budget, a GPU count and an MFU; read the days, and the GPUs a deadline needs."""
    return training_time_inputs(model, gpu).panel()


# ----------------------------------------------------------------------------------------- attention explorer


def encoder_attentions(model, tokenizer, sentence: str):
    """(tokens, weights) of a Hugging Face encoder: weights is (layers, heads, T, T), a float tensor.

    The model must be loaded with ``attn_implementation="eager"``: fused kernels never form the
    weights, so they cannot return them.
    """
    import torch

    encoded = tokenizer(sentence, return_tensors="pt")
    with torch.no_grad():
        attentions = model(**encoded, output_attentions=True).attentions
    if attentions is None or attentions[0] is None:
        raise ValueError('the model returned no attention weights; load it with attn_implementation="eager"')
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    return tokens, torch.stack(attentions)[:, 0]


def attention_explorer(model, tokenizer, sentences, *, layer: int = 0, head: int = 0):
    """Pick a sentence, a layer and a head of a Hugging Face encoder and see that head's attention map.

    The weights of every sentence are computed once, up front; moving a control only redraws the
    heatmap (:func:`scalebook.plots.attention_map`) inside an Output widget. The image is written into
    the widget's state rather than printed under ``with out:``, so it does not depend on a front end
    routing the output (the book's executor and nbval have none) and the cell prints nothing else.
    """
    import base64
    import io

    import ipywidgets as w
    import matplotlib.pyplot as plt

    from scalebook import plots

    sentences = list(sentences)
    if not sentences:
        raise ValueError("give at least one sentence to explore")
    maps = {s: encoder_attentions(model, tokenizer, s) for s in sentences}
    n_layers, n_heads = maps[sentences[0]][1].shape[:2]
    if not (0 <= layer < n_layers and 0 <= head < n_heads):
        raise ValueError(f"layer must be in [0, {n_layers}) and head in [0, {n_heads}), got {layer} and {head}")
    style = {"description_width": "70px"}
    sentence_box = w.Dropdown(options=sentences, value=sentences[0], description="sentence", style=style,
                              layout=w.Layout(width="560px"))  # fmt: skip
    layer_slider = w.IntSlider(value=layer, min=0, max=n_layers - 1, description="layer", style=style)
    head_slider = w.IntSlider(value=head, min=0, max=n_heads - 1, description="head", style=style)
    out = w.Output()

    def draw(_change=None) -> None:
        tokens, weights = maps[sentence_box.value]
        fig, ax = plt.subplots(figsize=(0.25 * len(tokens) + 2.2, 0.25 * len(tokens) + 1.8))
        plots.attention_map(weights[layer_slider.value, head_slider.value], tokens,
                            title=f"layer {layer_slider.value}, head {head_slider.value}", ax=ax)  # fmt: skip
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png")
        plt.close(fig)
        image = {
            "image/png": base64.b64encode(png.getvalue()).decode("ascii"),
            "text/plain": f"<attention map: layer {layer_slider.value}, head {head_slider.value}>",
        }
        out.outputs = ({"output_type": "display_data", "data": image, "metadata": {}},)

    for control in (sentence_box, layer_slider, head_slider):
        control.observe(draw, names="value")
    draw()
    return w.VBox([sentence_box, w.HBox([layer_slider, head_slider]), out])


# ---------------------------------------------------------------------------------------------- layout planner


def plan_table_html(model: str, gpu: str, nodes: int, seq_len: int, batch_tokens: int, top: int = 10) -> str:
    """The planner's best ``top`` layouts and its rejection counts as HTML (the widget's body)."""
    from scalebook import planner

    cluster = planner.Cluster(gpu=gpu, nodes=nodes)
    result = planner.plan(model, seq_len=seq_len, global_batch_tokens=batch_tokens, cluster=cluster)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in planner.LAYOUT_HEADERS)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in planner.layout_table(result.ranked[:top])
    )
    reasons = ", ".join(f"{html.escape(r)}: {n}" for r, n in result.rejected.most_common())
    if not result.ranked:
        return f"<b>No feasible layout.</b> Rejected: {reasons}"
    return f"<table><tr>{head}</tr>{rows}</table><p>Rejected: {reasons}</p>"


def layout_planner_inputs(model: str = "llama-3.1-405b", gpu: str = "h100-sxm") -> Calculator:
    """The layout planner: model, GPU, node count, sequence and batch in, :func:`plan_table_html` out."""
    controls = {
        "model": Control("model", model, tuple(configs.list_models())),
        "gpu": Control("GPU", gpu, tuple(configs.list_hardware())),
        "nodes": Control("nodes (x8 GPUs)", 2048, tuple(2**k for k in range(12))),
        "seq_len": Control("sequence", 8192, tuple(2**k for k in range(10, 18))),
        "batch_tokens": Control("batch (tokens)", 2**24, tuple(2**k for k in range(19, 26))),
    }
    return Calculator(controls, plan_table_html, "Cannot plan")


def layout_planner(model: str = "llama-3.1-405b", gpu: str = "h100-sxm"):
    """Pick a model, a GPU, a node count (8 GPUs each), a sequence and a batch; read the planner's ranking."""
    return layout_planner_inputs(model, gpu).panel()


CALCULATORS: dict[str, Callable[..., Calculator]] = {
    "memory": memory_calculator_inputs,
    "training-time": training_time_inputs,
    "layout-planner": layout_planner_inputs,
}


def calculator_html(name: str, form: Mapping[str, str]) -> str:
    """The HTML of calculator ``name`` (a key of ``CALCULATORS``) for a web form's text values.

    What the book's live calculators call in the browser; a bad input shows as the error message.
    """
    if name not in CALCULATORS:
        raise ValueError(f"unknown calculator {name!r}; choose one of {', '.join(CALCULATORS)}")
    return CALCULATORS[name]().html_from_form(form)
