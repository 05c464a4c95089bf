"""Floating-point formats from fp32 down to fp8, dynamic loss scaling, and fp8 matmuls simulated on a CPU.

A binary floating-point format with ``e`` exponent bits and ``m`` mantissa bits stores
``(-1)^s 2^(E - bias) (1 + M / 2^m)`` with ``bias = 2^(e-1) - 1``, and subnormals ``2^(1 - bias) M / 2^m``
when the stored exponent ``E`` is 0. So

    machine epsilon        2^-m                        (the gap above 1.0)
    smallest normal        2^(1 - bias)
    smallest subnormal     2^(1 - bias - m)
    largest finite         (2 - 2^-m) 2^(2^e - 2 - bias)       IEEE: the top exponent is inf and NaN
                           (2 - 2^(1-m)) 2^(2^e - 1 - bias)    "fn" (e4m3fn): only S.1111.111 is NaN, no inf
    spacing (ulp) of x     2^(floor(log2 |x|) - m) for normal x, the smallest subnormal below

:func:`float_format` derives these from the bit counts and the tests check them against ``torch.finfo``;
tf32 (8 exponent bits, 10 mantissa bits, what an NVIDIA tensor core reads from fp32 inputs) has no
torch dtype, so :func:`round_mantissa` emulates it by rounding an fp32 mantissa to 10 bits.

fp16 has 5 exponent bits: gradients below 2^-24 flush to zero and values above 65,504 overflow.
:class:`DynamicLossScaler` multiplies the loss by a scale S before backward (every gradient is
multiplied by S), divides the gradients by S before the optimizer step, skips steps whose gradients
hold inf or NaN and then multiplies S by ``backoff_factor``, and multiplies S by ``growth_factor`` after
``growth_interval`` clean steps in a row: the behaviour of ``torch.amp.GradScaler``.

FP8 training keeps a scale per group of values so that each group's largest magnitude (amax) maps to the
format's largest finite value: x ~ q * s with s = amax / max. torchao's float8 training uses one scale
per tensor; DeepSeek-V3 one per 1 x 128 tile of activations and per 128 x 128 block of weights, so that an
outlier spoils only its own group. :func:`fp8_linear` quantizes both operands, then multiplies the
dequantized values in fp32: it simulates fp8 storage and rounding, not a tensor core's fp8 arithmetic
(whose limited-precision accumulation DeepSeek-V3 works around by promoting partial sums to fp32).

Source: IEEE 754-2019; Micikevicius et al. 2018, "Mixed Precision Training" (loss scaling, fp32 master
weights); Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (e4m3, e5m2); NVIDIA, "NVIDIA A100
Tensor Core GPU Architecture" (TF32); PyTorch ``torch/amp/grad_scaler.py``; DeepSeek-AI 2024,
"DeepSeek-V3 Technical Report", Sec. 3.3 (fine-grained quantization); torchao ``float8`` (tensorwise
scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_RECIPES = ("tensor", "block")
_TILE = 128  # DeepSeek-V3's group size: 1 x 128 activation tiles, 128 x 128 weight blocks


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: its bit layout and the numbers the layout implies."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    finite_only: bool = False  # e4m3fn: no infinities, the top exponent holds normal numbers

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def eps(self) -> float:
        return 2.0**-self.mantissa_bits

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def max(self) -> float:
        if self.finite_only:  # only the all-ones mantissa of the top exponent is NaN
            return (2 - 2.0 ** (1 - self.mantissa_bits)) * 2.0 ** (2**self.exponent_bits - 1 - self.bias)
        return (2 - 2.0**-self.mantissa_bits) * 2.0 ** (2**self.exponent_bits - 2 - self.bias)

    def ulp(self, x: torch.Tensor) -> torch.Tensor:
        """The gap between representable values at each ``|x|`` (as fp64, for x within range)."""
        magnitude = x.double().abs().clamp_min(self.smallest_normal)
        return torch.exp2(torch.floor(torch.log2(magnitude)) - self.mantissa_bits)


FORMATS = {
    "fp32": FloatFormat("fp32", 8, 23),
    "tf32": FloatFormat("tf32", 8, 10),
    "bf16": FloatFormat("bf16", 8, 7),
    "fp16": FloatFormat("fp16", 5, 10),
    "fp8-e4m3": FloatFormat("fp8-e4m3", 4, 3, finite_only=True),
    "fp8-e5m2": FloatFormat("fp8-e5m2", 5, 2),
}
DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8-e4m3": torch.float8_e4m3fn,
    "fp8-e5m2": torch.float8_e5m2,
}  # tf32 has no dtype: see round_mantissa
_SAME_WIDTH_INT = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def float_format(name: str) -> FloatFormat:
    """The format called ``name``, one of ``FORMATS``."""
    if name not in FORMATS:
        raise ValueError(f"format must be one of {tuple(FORMATS)}, got {name!r}")
    return FORMATS[name]


def round_mantissa(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """fp32 ``x`` rounded to ``mantissa_bits`` (round to nearest, ties to even), kept in fp32.

    ``mantissa_bits=10`` is tf32; ``7`` gives the values of bf16. A carry out of the mantissa moves into
    the exponent, as it must (1.11...1 rounds up to 2.0); inf and NaN pass through.
    """
    if x.dtype != torch.float32 or not 0 <= mantissa_bits <= 23:
        raise ValueError(f"round_mantissa needs an fp32 tensor and 0 <= mantissa_bits <= 23, got "
                         f"{x.dtype} and {mantissa_bits}")  # fmt: skip
    drop = 23 - mantissa_bits
    if drop == 0:
        return x.clone()
    i = x.view(torch.int32)
    # Adding 0111..1 (plus the last kept bit, for ties to even) below the kept bits rounds to nearest.
    rounded = (i + ((i >> drop) & 1) + (1 << (drop - 1)) - 1) & ~((1 << drop) - 1)
    return torch.where(torch.isfinite(x), rounded.view(torch.float32), x)


def cast(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` rounded to format ``name`` and back to fp32: the value that format stores."""
    fmt = float_format(name)
    if name == "tf32":
        return round_mantissa(x.float(), fmt.mantissa_bits)
    return x.to(DTYPES[name]).float()


def bit_string(value: float, name: str) -> str:
    """The bits of ``value`` stored in format ``name``: sign, exponent and mantissa, separated by spaces."""
    fmt = float_format(name)
    if name == "tf32":  # the top 19 bits of the rounded fp32 word
        stored = round_mantissa(torch.tensor([value], dtype=torch.float32), fmt.mantissa_bits)
        word = int(stored.view(torch.int32).item()) & 0xFFFFFFFF
        raw = f"{word:032b}"[: fmt.bits]
    else:
        stored = torch.tensor([value], dtype=torch.float32).to(DTYPES[name])
        word = int(stored.view(_SAME_WIDTH_INT[fmt.bits]).item()) & (2**fmt.bits - 1)
        raw = f"{word:0{fmt.bits}b}"
    return f"{raw[0]} {raw[1 : 1 + fmt.exponent_bits]} {raw[1 + fmt.exponent_bits :]}"


def representable_values(name: str) -> torch.Tensor:
    """Every finite non-negative value of an 8-bit format, ascending (all 128 sign-0 bit patterns)."""
    if float_format(name).bits != 8:
        raise ValueError(f"only the fp8 formats can be enumerated here, got {name!r}")
    values = torch.arange(128, dtype=torch.uint8).view(DTYPES[name]).double()
    return values[torch.isfinite(values)]


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training, with the interface and behaviour of ``torch.amp.GradScaler``.

    ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``: ``step`` unscales the
    gradients (unless :meth:`unscale_` already did, e.g. to clip them) and skips ``optimizer.step()`` if
    any gradient is inf or NaN; ``update`` then backs the scale off, or grows it after ``growth_interval``
    clean steps. The scale is an fp32 number, as GradScaler keeps it.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):  # fmt: skip
        problems = []
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            problems.append(f"init_scale must be a finite number > 0, got {init_scale!r}")
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1):
            problems.append(f"growth_factor must be > 1, got {growth_factor!r}")
        if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
            problems.append(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            problems.append(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        if problems:
            raise ValueError("; ".join(problems))
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._clean_steps = 0  # consecutive steps without inf/NaN
        self._found_inf: dict[int, bool] = {}  # per optimizer, since the last update()
        self._stepped: set[int] = set()
        self.skipped_steps = 0

    def get_scale(self) -> float:
        return float(self._scale)

    def state_dict(self) -> dict:
        """The scaler's state under GradScaler's keys, so that either can resume from the other's checkpoint."""
        return {"scale": self.get_scale(), "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._clean_steps}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self._scale = torch.tensor(float(state["scale"]), dtype=torch.float32)
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self._clean_steps = state["growth_interval"], state["_growth_tracker"]

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``: backward through it yields gradients multiplied by S."""
        return loss * self._scale.to(loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by S in place and record whether any is inf or NaN."""
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update()")
        inv_scale = self._scale.double().reciprocal().float()  # GradScaler's exact fp32 factor
        found_inf = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        found_inf |= not bool(torch.isfinite(p.grad).all())
                        p.grad.mul_(inv_scale.to(p.grad.device))
        self._found_inf[id(optimizer)] = found_inf

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """``optimizer.step()`` on the unscaled gradients, unless one is inf or NaN (then nothing)."""
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() was already called on this optimizer since the last update()")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        if self._found_inf[id(optimizer)]:
            self.skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after an overflow, or grow after ``growth_interval`` clean steps in a row."""
        if not self._found_inf:
            raise RuntimeError("update() needs a step() (or unscale_()) since the last update()")
        # As GradScaler's kernel: the fp32 scale times the (double) factor, rounded back to fp32.
        if any(self._found_inf.values()):
            self._scale = torch.tensor(float(self._scale) * self.backoff_factor, dtype=torch.float32)
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                grown = torch.tensor(float(self._scale) * self.growth_factor, dtype=torch.float32)
                if torch.isfinite(grown):  # GradScaler keeps the old scale rather than reach inf
                    self._scale = grown
                self._clean_steps = 0
        self._found_inf.clear()
        self._stepped.clear()


def _groups(shape: tuple[int, int], block: tuple[int, int] | None) -> tuple[int, int]:
    return shape if block is None else block


def quantize_fp8(x: torch.Tensor, *, block: tuple[int, int] | None = None, name: str = "fp8-e4m3"):
    """2-D ``x`` as fp8 values and fp32 scales, ``x ~ q * s``, one scale per tensor or per ``block``.

    Each group's scale is s = amax / max (an all-zero group gets s = 1), so its largest magnitude lands
    on the format's largest finite value. A partial block at an edge gets its own scale. Returns
    ``(q, scales)``: ``q`` has the dtype of ``name`` and the shape of ``x``; ``scales`` has one entry per
    block, shape ``(ceil(rows / r), ceil(cols / c))`` (``(1, 1)`` per tensor).
    """
    fmt = float_format(name)
    if fmt.bits != 8 or x.dim() != 2 or (block is not None and (len(block) != 2 or min(block) < 1)):
        raise ValueError(f"quantize_fp8 needs an fp8 format, a 2-D tensor and block None or (rows, cols) >= 1; "
                         f"got {name!r}, shape {tuple(x.shape)}, block {block!r}")  # fmt: skip
    r, c = _groups(tuple(x.shape), block)
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -cols % c, 0, -rows % r))
    amax = padded.abs().unflatten(0, (-1, r)).unflatten(2, (-1, c)).amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    expanded = _expand(scales, (r, c), tuple(x.shape))
    # Clamp before the cast: rounding can push amax / s a hair past max, and out-of-range casts are not portable.
    q = (x.float() / expanded).clamp(-fmt.max, fmt.max).to(DTYPES[name])
    return q, scales


def _expand(scales: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    full = scales.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, *, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The fp32 values ``q * s`` that :func:`quantize_fp8` encoded."""
    return q.float() * _expand(scales, _groups(tuple(q.shape), block), tuple(q.shape))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, *, recipe: str = "block") -> torch.Tensor:
    """``x @ weight.T`` with both operands rounded to fp8 e4m3, multiplied in fp32.

    ``recipe="tensor"``: one scale per tensor (torchao's tensorwise float8). ``"block"``: DeepSeek-V3's
    1 x 128 tiles of ``x`` (per token, along the reduced dimension) and 128 x 128 blocks of ``weight``.
    """
    if recipe not in FP8_RECIPES:
        raise ValueError(f"recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_linear needs x (tokens, d_in) and weight (d_out, d_in); got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")  # fmt: skip
    x_block, w_block = ((1, _TILE), (_TILE, _TILE)) if recipe == "block" else (None, None)
    x8 = dequantize_fp8(*quantize_fp8(x, block=x_block), block=x_block)
    w8 = dequantize_fp8(*quantize_fp8(weight, block=w_block), block=w_block)
    return x8 @ w8.T
