"""Pure 16-bit training: no float32 master weights, and updates that are not lost anyway.

A bfloat16 weight of 1.0 cannot take an update of 1e-4: the spacing of bfloat16 at
1.0 is 2**-7, and ``1.0 - 1e-4`` rounds back to ``1.0`` every step. float32 master
weights (O2) fix that at 4 bytes (plus a 4-byte gradient copy) per parameter.
Zamirai et al., "Revisiting BFloat16 Training" (2020), fix it in the update instead:

- **Kahan summation**: a 16-bit buffer per weight keeps what the last rounding lost
  and adds it back into the next update (2 bytes per parameter). From torch-optimi
  (``optimi.SGD`` / ``optimi.AdamW`` with ``kahan_sum=True``), which computes each
  update in float32 and keeps its optimizer states in the weights' dtype.
- **Stochastic rounding**: the float32 result rounds up or down at random, with
  probabilities that make the rounding unbiased, so small updates survive on
  average (0 bytes). ampkit's own (``StochasticRoundingOptimizer``): torchao's
  ``_AdamW(bf16_stochastic_round=True)`` covers AdamW on bfloat16 only, and compiles
  every step function with torch.compile, which takes seconds per shape on a CPU.

``pure16_optimizer`` turns a torch.optim SGD or AdamW into either;
``initialize(model, optimizer, "O3", update="kahan")`` does it for O3.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ampkit.shards import local_shard

UPDATES = ("plain", "kahan", "stochastic")


def stochastic_round(values: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round float32 ``values`` to ``dtype``, up or down at random, unbiased.

    Each value goes to one of its two neighbours in ``dtype`` with probability
    proportional to its closeness, so ``E[round(x)] == x``: 10,000 additions of
    1e-4 to 1.0 in bfloat16 land near 2.0 instead of staying at 1.0.

    Args:
        values: a float32 tensor.
        dtype: torch.bfloat16 or torch.float16.
        generator: for reproducible draws (default: torch's global generator).

    Returns:
        A ``dtype`` tensor; values exactly representable come back unchanged,
        inf/NaN as nearest rounding gives them.
    """
    if dtype == torch.bfloat16:
        return _cut_to_bfloat16(values, generator).to(dtype)  # exact: the low bits are zero
    nearest = values.to(dtype)
    error = values - nearest.float()
    # The other neighbour, on the side of the error; its distance is the local spacing.
    other = torch.nextafter(nearest, torch.where(error > 0, math.inf, -math.inf).to(dtype))
    spacing = (other.float() - nearest.float()).abs()
    probability = torch.where(spacing > 0, error.abs() / spacing, torch.zeros_like(error))
    draw = torch.rand(values.shape, generator=generator, device=values.device)
    return torch.where((draw < probability) & (error != 0), other, nearest)


def _cut_to_bfloat16(values: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """float32 ``values`` stochastically rounded to bfloat16's precision, still float32 (low 16 bits zero).

    bfloat16 is float32's upper 16 bits: add 16 random low bits to the magnitude and cut
    them off. A value rounds away from zero with probability (its low bits) / 2**16: unbiased.
    """
    bits = values.contiguous().view(torch.int32) + _random_low_bits(values.numel(), values.device, generator).view(
        values.shape)
    cut = bits.bitwise_and_(-65536).view(torch.float32)
    # A NaN's carry could reach the sign bit: keep NaN a NaN. One summing read decides (a host read per
    # parameter: free on the CPU, a sync on a GPU); an unconditional where costs more (it writes every value).
    if values.sum().isnan():
        cut = torch.where(values.isnan(), values, cut)
    return cut


def _random_low_bits(n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` int32 values uniform in [0, 2**16): four from each full-range 64-bit draw
    (torch draws 64 random bits for about the cost of one 32-bit ``randint`` value)."""
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None, generator=generator)
    return words.view(torch.int16)[:n].to(torch.int32).bitwise_and_(0xFFFF)


class StochasticRoundingOptimizer(torch.optim.Optimizer):
    """SGD (with momentum and weight decay) or AdamW, each update computed in float32 and each 16-bit weight
    it writes stochastically rounded.

    Optimizer states are kept in the weights' dtype (as torch-optimi does) or in ``state_dtype``. A 16-bit
    state whose step changes it by less than half a 16-bit spacing is rounded stochastically too: AdamW's
    second moment decays by ``beta2`` (0.999) a step, so rounded to nearest it never decays at all
    (``ampkit.optim.states``); the first moment (0.9) is rounded to nearest, where stochastic rounding's
    noise cost loss in pure bf16 training on the GPT. float32 weights (O2's masters, with ``state_dtype=torch.bfloat16``) are
    written exactly.

    Args:
        params: 16-bit parameters (or groups).
        kind: ``"sgd"`` or ``"adamw"``.
        lr: learning rate.
        momentum: SGD's (default 0).
        weight_decay: SGD's (default 0); AdamW's is decoupled as torch.optim.AdamW's (default 0.01).
        betas: AdamW's (default as torch.optim.AdamW's).
        eps: AdamW's (default as torch.optim.AdamW's).
        seed: seed of the rounding's random draws (default 0: reproducible runs). A parameter's draws at a
            step follow from the seed, its index and its count of steps (``"rounded_steps"`` in its state), so
            a run resumed from a checkpoint, sharded or not, draws as an uninterrupted one.
        state_dtype: the moments' (momentum buffer's) dtype: None (default: each weight's own),
            ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
        state_rounding: how 16-bit states are written: ``"auto"`` (default: stochastically where a step's change
            is below half a 16-bit spacing, AdamW's second moment; to nearest where it is not, the first moment
            and SGD's momentum at 0.9), ``"stochastic"`` or ``"nearest"`` (as torch's and torch-optimi's
            optimizers keep 16-bit moments: a second moment then never decays).

    Raises:
        ValueError: an unknown kind or a bad hyperparameter.
    """

    def __init__(self, params: Any, kind: str, lr: float, momentum: float = 0.0, weight_decay: float | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, seed: int = 0,
                 state_dtype: torch.dtype | None = None, state_rounding: str = "auto") -> None:
        if kind not in ("sgd", "adamw"):
            raise ValueError(f"Unknown kind {kind!r}: choose 'sgd' or 'adamw'.")
        if state_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"state_dtype={state_dtype!r} is not a state dtype: choose None (the weights'), "
                             "torch.float32, torch.bfloat16 or torch.float16.")
        if state_rounding not in ("auto", "stochastic", "nearest"):
            raise ValueError(f"state_rounding={state_rounding!r} is not a rounding: choose 'auto', 'stochastic' or "
                             "'nearest'.")
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr={lr!r} is invalid: use a finite learning rate >= 0.")
        weight_decay = (0.01 if kind == "adamw" else 0.0) if weight_decay is None else weight_decay
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "betas": betas,
                                  "eps": eps})
        self.kind = kind
        self.state_dtype, self.state_rounding = state_dtype, state_rounding
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One update of every parameter with a gradient."""
        loss = closure() if closure is not None else None
        for index, (group, p) in enumerate((group, p) for group in self.param_groups for p in group["params"]):
            if p.grad is None:
                continue
            state = self.state[p]
            weight, grad = p.float(), p.grad.float()
            generator = self._generator_for(p, index, state)
            store = functools.partial(self._store_state, generator=generator)
            if self.kind == "sgd":
                _sgd_update(weight, grad, state, group, self.state_dtype or p.dtype, store)
            else:
                _adamw_update(weight, grad, state, group, self.state_dtype or p.dtype, store)
            _store(p, weight, generator)
        return loss

    def _store_state(self, target: torch.Tensor, values: torch.Tensor, coefficient: float,
                     generator: torch.Generator) -> None:
        """Write a state whose update weighs the new value by ``coefficient`` (1 - beta): stochastically rounded
        where that is below half of bfloat16's relative spacing (2**-9: AdamW's second moment, 0.001), where
        rounding to nearest would lose every step's change, else to nearest (the first moment, 0.1: in pure bf16
        training stochastic rounding's noise there cost loss on the GPT, ``benchmarks/bench_bf16_moments.py``)."""
        nearest = self.state_rounding == "nearest" or (self.state_rounding == "auto" and coefficient >= 2**-9)
        _store(target, values, generator, nearest)

    def _generator_for(self, p: torch.Tensor, index: int, state: dict[str, Any]) -> torch.Generator:
        """The generator of this parameter's draws at this step, seeded from (seed, the parameter's index, its
        count of rounded steps): the draws follow from the state alone, so a resumed run (whose state carries the
        count, through a sharded checkpoint too) draws what an uninterrupted one would."""
        count = state.get("rounded_steps", 0)
        state["rounded_steps"] = count + 1
        generator = self._generators.get(p.device)
        if generator is None:
            generator = self._generators[p.device] = torch.Generator(device=p.device)
        return generator.manual_seed(((self.seed * 1_000_003 + index) * 1_000_033 + count) % 2**63)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()``. The states keep their saved dtype, the moments ``state_dtype`` where it is
        set (a plain AdamW's float32 moments loaded into bf16 ones are rounded to nearest): torch.optim casts them to
        their parameter's, which would round float32 moments of 16-bit weights, or widen bfloat16 moments of float32
        masters."""
        super().load_state_dict(state_dict)
        # the saved groups name each parameter (an index, or a name in torch.distributed.checkpoint's dicts)
        names = [name for group in state_dict["param_groups"] for name in group["params"]]
        params = dict(zip(names, (p for group in self.param_groups for p in group["params"])))
        for name, saved in state_dict["state"].items():
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    dtype = self.state_dtype if self.state_dtype is not None and key in _MOMENTS else value.dtype
                    self.state[params[name]][key] = value.to(device=params[name].device, dtype=dtype, copy=True)


_MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")  # the states state_dtype keeps


def _store(target: torch.Tensor, values: torch.Tensor, generator: torch.Generator | None, nearest: bool = False) -> None:
    """Write float32 ``values`` into ``target``: exactly in float32, stochastically rounded in 16 bits (rounded to
    nearest with ``nearest``).

    An FSDP2 tensor is written on this rank's shard (its states stay DTensors, as checkpoints need).
    """
    target, values = local_shard(target), local_shard(values)
    if target.dtype == torch.float32 or nearest:
        target.copy_(values)
    elif target.dtype == torch.bfloat16:
        target.copy_(_cut_to_bfloat16(values, generator))  # exact: the low bits are zero
    else:
        target.copy_(stochastic_round(values, target.dtype, generator))


def _sgd_update(weight: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                dtype: torch.dtype, store: Callable[[torch.Tensor, torch.Tensor, float], None]) -> None:
    """torch.optim.SGD's step (no dampening or Nesterov) applied to float32 ``weight`` in place;
    the momentum buffer is kept in ``dtype``, written by ``store`` (with its update's weight of the new value)."""
    if group["weight_decay"]:
        grad = grad.add(weight, alpha=group["weight_decay"])  # not in place: may be the gradient itself
    if group["momentum"]:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(weight, dtype=dtype)
            buffer = grad
        else:
            buffer = state["momentum_buffer"].float().mul_(group["momentum"]).add_(grad)
        store(state["momentum_buffer"], buffer, 1 - group["momentum"])
        grad = buffer
    weight.add_(grad, alpha=-group["lr"])


def _adamw_update(weight: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                  dtype: torch.dtype, store: Callable[[torch.Tensor, torch.Tensor, float], None]) -> None:
    """torch.optim.AdamW's step (its formula, in its order) applied to float32 ``weight`` in place;
    the moments are kept in ``dtype``, written by ``store`` (with each one's weight of the new value)."""
    beta1, beta2 = group["betas"]
    if "step" not in state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(weight, dtype=dtype)
        state["exp_avg_sq"] = torch.zeros_like(weight, dtype=dtype)
    state["step"] += 1
    step = state["step"]
    weight.mul_(1 - group["lr"] * group["weight_decay"])
    exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    store(state["exp_avg"], exp_avg, 1 - beta1)
    store(state["exp_avg_sq"], exp_avg_sq, 1 - beta2)
    denominator = exp_avg_sq.sqrt().div_(math.sqrt(1 - beta2**step)).add_(group["eps"])
    weight.addcdiv_(exp_avg, denominator, value=-group["lr"] / (1 - beta1**step))


def check_update(update: str) -> None:
    """Refuse an unknown update rule (ValueError naming the choices)."""
    if update not in UPDATES:
        raise ValueError(f"Unknown update {update!r}. Choose one of {list(UPDATES)}: 'plain' rounds every update to "
                         "the nearest 16-bit value (small ones are lost), 'kahan' keeps the rounding error in a 16-bit "
                         "buffer, 'stochastic' rounds at random, unbiased.")


def pure16_optimizer(optimizer: torch.optim.Optimizer, update: str = "kahan") -> torch.optim.Optimizer:
    """The same optimizer (SGD or AdamW, same groups and hyperparameters) with an update that keeps
    small steps on 16-bit weights.

    Args:
        optimizer: a ``torch.optim.SGD`` (no dampening, no Nesterov) or ``torch.optim.AdamW``
            (no amsgrad) over the model's parameters, before it has stepped.
        update: ``"kahan"`` (default: torch-optimi with Kahan summation, a 16-bit compensation
            buffer per weight), ``"stochastic"`` (StochasticRoundingOptimizer) or ``"plain"``
            (``optimizer`` itself: every update rounds to nearest).

    Returns:
        The new optimizer (``optimizer`` for ``"plain"``).

    Raises:
        ValueError: an unknown update, another optimizer class, or an option the pure 16-bit
            optimizers do not have (named, with the fix).

    Examples:
        >>> model.to(torch.bfloat16)
        >>> optimizer = ampkit.pure16_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "kahan")
    """
    check_update(update)
    if update == "plain":
        return optimizer
    kind, groups = pure16_groups(optimizer, update)
    if update == "stochastic":
        return StochasticRoundingOptimizer(groups, kind, lr=groups[0]["lr"])
    import optimi  # torch-optimi: the `pure16` extra (pure16_groups checked it is there)

    if kind == "sgd":
        # optimi.SGD's momentum is torch's (without dampening) when torch_init=True.
        return optimi.SGD(groups, lr=groups[0]["lr"], kahan_sum=True, torch_init=True)
    for group in groups:  # optimi's groups name the betas apart
        group["beta1"], group["beta2"] = group.pop("betas")
    return optimi.AdamW(groups, lr=groups[0]["lr"], kahan_sum=True)


def pure16_groups(optimizer: torch.optim.Optimizer, update: str) -> tuple[str, list[dict[str, Any]]]:
    """Check that ``optimizer`` can become a pure 16-bit optimizer with ``update`` (``"kahan"`` or
    ``"stochastic"``), changing nothing; returns its kind (``"sgd"``, ``"adamw"``) and parameter groups.

    ``initialize`` calls it before it casts the model, so a refusal leaves the model as it was.

    Raises:
        ValueError: another optimizer class, one that has stepped, or an unsupported option.
        ImportError: ``"kahan"`` without torch-optimi.
    """
    kind = {torch.optim.SGD: "sgd", torch.optim.AdamW: "adamw"}.get(type(optimizer))  # type: ignore[call-overload]
    if kind is None and (isinstance(optimizer, StochasticRoundingOptimizer)
                         or type(optimizer).__module__.startswith("optimi")):
        raise ValueError(f"update={update!r}: the optimizer is already a pure 16-bit one ({type(optimizer).__module__}."
                         f"{type(optimizer).__qualname__}, what ampkit builds for update='kahan' or 'stochastic'): "
                         "convert the torch.optim optimizer once, and use what that returns.")
    if kind is None:
        raise ValueError(f"update={update!r} needs a torch.optim.SGD or torch.optim.AdamW, got "
                         f"{type(optimizer).__module__}.{type(optimizer).__qualname__}: build one of those (or use "
                         "update='plain').")
    if optimizer.state:
        raise ValueError("The optimizer has already stepped: convert it before training (its state would be lost).")
    unsupported: dict[str, object] = ({"dampening": 0, "nesterov": False, "maximize": False} if kind == "sgd"
                                      else {"amsgrad": False, "maximize": False})
    refuse_options(optimizer, unsupported, f"by the pure 16-bit {kind} optimizers", "O2 (float32 master weights)")
    groups = []
    for group in optimizer.param_groups:
        lr = float(group["lr"])
        hyper = ({"lr": lr, "momentum": group["momentum"], "weight_decay": group["weight_decay"]} if kind == "sgd"
                 else {"lr": lr, "betas": tuple(group["betas"]), "eps": group["eps"],
                       "weight_decay": group["weight_decay"]})
        kept = {key: value for key, value in group.items() if key not in optimizer.defaults}  # a name, initial_lr
        groups.append({**kept, "params": group["params"], **hyper})
    if update == "kahan":
        try:
            import optimi  # noqa: F401  (torch-optimi: the `pure16` extra)
        except ImportError as error:
            raise ImportError("update='kahan' uses torch-optimi, which is not installed: pip install 'ampkit[pure16]' "
                              "(or torch-optimi), or use update='stochastic'.") from error
    return kind, groups


def refuse_options(optimizer: torch.optim.Optimizer, options: Mapping[str, object], where: str, fix: str) -> None:
    """Raise ValueError where a group of ``optimizer`` sets one of ``options`` to other than its plain value (the
    dict's), naming it, ``where`` it is not supported, and the ``fix``."""
    for group in optimizer.param_groups:
        for option, plain in options.items():
            if group.get(option, plain) != plain:
                raise ValueError(f"{option}={group[option]!r} is not supported {where}: use {option}={plain!r}, or "
                                 f"{fix}.")
