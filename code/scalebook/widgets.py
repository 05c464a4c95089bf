"""Interactive calculators and explorers for the chapters, built with ipywidgets.

Each widget is thin: the numbers come from the package (``accounting``, the models), the widget only
lets the reader move the inputs. A widget needs a running kernel, so every chapter that shows one also
shows a static figure of the same thing, which is what the built book and a non-interactive reader see.

Source: ipywidgets documentation, "Using Interact" and "Output widgets".
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from scalebook import accounting, configs
from scalebook.configs import ModelConfig

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
    attention: str = "explicit",
    gpu: str = "h100-sxm",
) -> MemoryEstimate:
    """Model states plus activations on one GPU: ``accounting.model_state_bytes`` + ``activation_bytes``.

    Adam; activations are 16-bit unless ``precision="fp32"``; GPT-layout models keep Korthikanti et
    al.'s dropout masks, Llama-layout models train without dropout; ``attention="fused"`` stores no
    attention scores (FlashAttention). Pipeline parallelism divides the
    model states by ``pp`` but not the activations: under 1F1B the first stage holds L/pp layers for pp
    micro-batches in flight, as many bytes as all L layers of one micro-batch. Not counted: the logits
    and the loss, temporary buffers, and the allocator's fragmentation.
    """
    cfg = configs.get_model(model) if isinstance(model, str) else model
    device = configs.get_hardware(gpu)
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
        'border-left:2px dashed black"></div></div>'
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


_DEGREES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def memory_calculator(model: str = "gpt3-175b", gpu: str = "h100-sxm"):
    """Pick a model, a sequence, a precision and a parallel layout; read the bytes each GPU holds.

    A thin panel over :func:`memory_per_gpu`: every change recomputes the estimate, and a layout the
    formulas reject (tp not dividing the heads, say) shows the error instead.
    """
    import ipywidgets as w

    style = {"description_width": "90px"}
    layout = w.Layout(width="230px")

    def dropdown(description, options, value):
        return w.Dropdown(description=description, options=options, value=value, style=style, layout=layout)

    controls = {
        "model": dropdown("model", configs.list_models(), model),
        "gpu": dropdown("GPU", configs.list_hardware(), gpu),
        "precision": dropdown("precision", accounting.PRECISIONS, "mixed"),
        "seq_len": dropdown("sequence", [2**k for k in range(9, 18)], 2048),
        "micro_batch": dropdown("micro-batch", [1, 2, 4, 8, 16, 32], 1),
        "recompute": dropdown("recompute", accounting.RECOMPUTE, "none"),
        "attention": dropdown("attention", accounting.ATTENTION, "explicit"),
        "zero_stage": dropdown("ZeRO stage", accounting.ZERO_STAGES, 0),
        "dp": dropdown("dp", _DEGREES, 1),
        "tp": dropdown("tp", _DEGREES[:8], 1),
        "pp": dropdown("pp", _DEGREES, 1),
        "sp": w.Checkbox(description="sequence parallel", value=False, style=style, layout=layout),
    }
    result = w.HTML()

    def update(_change=None) -> None:
        try:
            estimate = memory_per_gpu(**{name: control.value for name, control in controls.items()})
        except ValueError as error:
            result.value = f"<b>Not a valid layout:</b> {html.escape(str(error))}"
            return
        result.value = memory_estimate_html(estimate)

    for control in controls.values():
        control.observe(update, names="value")
    update()
    grid = w.GridBox(list(controls.values()), layout=w.Layout(grid_template_columns="repeat(3, 240px)"))
    return w.VBox([grid, result])


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
        raise ValueError(
            f"layer must be in [0, {n_layers}) and head in [0, {n_heads}), got {layer} and {head}"
        )
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


def layout_planner(model: str = "llama-3.1-405b", gpu: str = "h100-sxm"):
    """Pick a model, a GPU, a node count (8 GPUs each), a sequence and a batch; read the planner's ranking."""
    import ipywidgets as w

    style = {"description_width": "110px"}
    controls = {
        "model": w.Dropdown(description="model", options=configs.list_models(), value=model, style=style),
        "gpu": w.Dropdown(description="GPU", options=configs.list_hardware(), value=gpu, style=style),
        "nodes": w.Dropdown(description="nodes (x8 GPUs)", options=[2**k for k in range(12)], value=2048, style=style),
        "seq_len": w.Dropdown(description="sequence", options=[2**k for k in range(10, 18)], value=8192, style=style),
        "batch_tokens": w.Dropdown(
            description="batch (tokens)", options=[2**k for k in range(19, 26)], value=2**24, style=style
        ),
    }
    result = w.HTML()

    def update(_change=None) -> None:
        try:
            result.value = plan_table_html(**{name: c.value for name, c in controls.items()})
        except ValueError as error:
            result.value = f"<b>Cannot plan:</b> {html.escape(str(error))}"

    for control in controls.values():
        control.observe(update, names="value")
    update()
    return w.VBox([w.HBox(list(controls.values())[:3]), w.HBox(list(controls.values())[3:]), result])
