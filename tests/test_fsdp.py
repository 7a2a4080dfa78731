"""FSDP2 at ampkit's opt levels on 2 gloo ranks: dtypes, losses against one process, agreed skips,
FP8 all-gathers and amaxes, sharded checkpoints, memory, and the refusals (bounded time, free ports)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampkit
import ampkit.distributed
from ampkit.distributed import fsdp
from ampkit.distributed.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from ampkit.experiment.models import GPT
from multiprocess import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # each spawns 2 ranks: 10-40 s here
STEPS, PER_RANK, CONTEXT = 5, 4, 16


def _gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(d_model=32, n_layers=2, n_heads=2, context=CONTEXT)


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step % 2)  # two batches in turn: a loss that falls, step by step
    tokens = torch.randint(0, 256, (2 * PER_RANK, CONTEXT + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def _rank_step(model: nn.Module, step: int, rank: int, world: int) -> tuple[torch.Tensor, float]:
    """This rank's loss on its slice of the global batch, and the global loss (the mean over ranks)."""
    x, y = _global_batch(step)
    loss = _loss(model, x[rank::world], y[rank::world])
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return loss, mean.item() / world


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    """STEPS plain steps on this rank's slices; the global losses."""
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss, mean = _rank_step(model, step, rank, world)
        loss.backward()
        optimizer.step()
        losses.append(mean)
    return losses


def _record_dtypes(model: nn.Module) -> dict[str, tuple[torch.dtype, torch.dtype]]:
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            module.register_forward_hook(
                lambda m, args, out, name=name: seen.__setitem__(name, (m.weight.dtype, out.dtype)))
    return seen


class _RMSNorm(nn.Module):
    """transformers' RMSNorm in short: its float32 weight times a 16-bit input promotes to float32."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x.float() * x.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()).to(x.dtype)


# -- workers (run in the spawned ranks) ---------------------------------------------------------


def _levels_worker(rank: int, world: int) -> dict:
    out = {}
    for level, reduce_dtype in (("O1", torch.float32), ("O2", torch.float32), ("O2", torch.bfloat16),
                                ("O3", torch.float32)):
        model = _gpt()
        seen = _record_dtypes(model)
        model = fsdp.fully_shard(model, opt_level=level, dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                 compute="float32")
        optimizer = fsdp.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses = _train(model, optimizer, rank, world)
        x, _ = _global_batch(0)
        output = model(x[:1])
        layout = fsdp.sharding(model)
        out[(level, reduce_dtype)] = {
            "losses": losses, "seen": dict(seen), "output": output.dtype, "blocks": layout.blocks,
            "float32": layout.float32, "bytes_sent": layout.bytes_sent,
            "param": (type(next(model.parameters())).__name__, next(model.parameters()).dtype),
            "state_bytes": ampkit.measured_state_bytes(model, optimizer),  # gradients are still there
        }
    return out


def _scaler_worker(rank: int, world: int) -> dict:
    out = {}
    for kind in ("dynamic", "adaptive"):
        model = fsdp.fully_shard(_gpt(), opt_level="O2", dtype=torch.float16, reduce_dtype=torch.float32,
                                 compute="float32")
        optimizer = fsdp.prepare_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        # No process_group: the scaler finds the shards' group on the gradients.
        scaler = (ampkit.DynamicLossScaler(init_scale=2.0**10) if kind == "dynamic"
                  else ampkit.AdaptiveLossScaler(model, init_scale=2.0**10))
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        loss, _ = _rank_step(model, 0, rank, world)
        scaler.scale(loss).backward()
        if rank == 0:  # one rank's shard overflows; the other rank's gradients are clean
            next(model.parameters()).grad.to_local().view(-1)[0] = math.inf
        stepped_inf = scaler.step(optimizer)
        scaler.update()
        unchanged = all(torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))
        optimizer.zero_grad(set_to_none=True)
        loss, _ = _rank_step(model, 1, rank, world)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        full = torch.stack([p.grad.full_tensor().float().norm() for p in model.parameters()]).norm()
        norm = scaler.clip_grad_norm_(optimizer, max_norm=1e-3)
        clipped = torch.stack([p.grad.full_tensor().float().norm() for p in model.parameters()]).norm()
        stepped = scaler.step(optimizer)
        scaler.update()
        out[kind] = {"stepped_inf": stepped_inf, "unchanged": unchanged, "scale": scaler.get_scale(),
                     "stepped": stepped, "norm": float(norm), "full_norm": float(full), "clipped": float(clipped),
                     "skipped": scaler.stats.skipped}
    # A float16 reduce-scatter whose sum overflows: it warns, counts, and the scaler skips the step on both ranks.
    model = fsdp.fully_shard(_gpt(), opt_level="O2", dtype=torch.float16, reduce_dtype=torch.float16,
                             predivide_factor=1.0, compute="float32")
    optimizer = fsdp.prepare_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**24)  # scaled gradients far past float16's 65504
    loss, _ = _rank_step(model, 0, rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.scale(loss).backward()
    out["fp16_reduce"] = {"overflows": fsdp.sharding(model).overflows, "stepped": scaler.step(optimizer),
                          "warned": any(issubclass(w.category, ampkit.distributed.ReductionOverflowWarning)
                                        and "predivide factor 1" in str(w.message) for w in caught)}
    return out


def _fp8_worker(rank: int, world: int) -> dict:
    out = {}
    model = _gpt()
    ampkit.convert_to_fp8(model, ampkit.Fp8Recipe(), process_group=dist.group.WORLD, emulate=True)
    model = fsdp.fully_shard(model, opt_level="O1", dtype=torch.bfloat16, compute="float32")
    optimizer = fsdp.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss, _ = _rank_step(model, step, rank, world)
        loss.backward()
        optimizer.step()
    out["delayed"] = {name: b.clone() for name, b in model.named_buffers() if name.endswith("amax_history")}
    out["current"] = _current_fp8(rank, world, fsdp_all_gather=True)
    # O2 shards the norms on their own: a block's all-gather is all FP8, which gloo has no type for (ampkit sends it
    # as bytes); O3 cannot keep torchao's float32 weights in 16 bits, and is refused with the model as it was
    out["current_o2"] = _fp8_gathers_o2(rank, world)
    model = _gpt()
    ampkit.convert_to_fp8(model, ampkit.Fp8Recipe(scaling="current", fsdp_all_gather=True), emulate=True)
    before = {name: (p, p.dtype) for name, p in model.named_parameters()}
    try:
        fsdp.fully_shard(model, opt_level="O3", dtype=torch.bfloat16)
        out["o3"] = "accepted"
    except ValueError as error:
        out["o3"] = str(error)
    out["o3_untouched"] = before == {name: (p, p.dtype) for name, p in model.named_parameters()}
    return out


def _current_fp8(rank: int, world: int, fsdp_all_gather: bool) -> dict:
    model = _gpt()
    ampkit.convert_to_fp8(model, ampkit.Fp8Recipe(scaling="current", fsdp_all_gather=fsdp_all_gather), emulate=True)
    if world > 1:
        model = fsdp.fully_shard(model, opt_level="O0")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        if world > 1:
            loss, mean = _rank_step(model, step, rank, world)
        else:
            loss = _loss(model, *_global_batch(step))
            mean = loss.item()
        loss.backward()
        optimizer.step()
        if world > 1:
            fsdp.precompute_fp8_scales(model)
        losses.append(mean)
    weight = model.blocks[0].mlp[0].weight
    local = weight.to_local() if world > 1 else weight
    return {"losses": losses, "weight_type": type(local).__name__}


class _Block(nn.Module):
    """A bias-free MLP block (a transformers LM's, as Llama's or Qwen's): at O2 its norm is a unit of its own and
    every weight left in it is FP8."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(32), nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _fp8_gathers_o2(rank: int, world: int) -> dict:
    """O2 with FP8 all-gathers of bias-free blocks: losses of 3 steps, on ``world`` ranks or in one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _Block(), _Block(), nn.Linear(32, 16))
    ampkit.convert_to_fp8(model, ampkit.Fp8Recipe(scaling="current", fsdp_all_gather=world > 1), emulate=True)
    if world > 1:
        model = fsdp.fully_shard(model, opt_level="O2", dtype=torch.bfloat16, compute="float32")
        optimizer = fsdp.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
        model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2",
                                             torch.bfloat16, compute="float32")
    x, y = torch.randn(2 * PER_RANK, 16, generator=torch.Generator().manual_seed(1)), torch.zeros(2 * PER_RANK, 16)
    losses = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        if world > 1:
            fsdp.precompute_fp8_scales(model)
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    local = model[1].up.weight
    return {"losses": losses, "weight_type": type(local.to_local() if world > 1 else local).__name__}


def _checkpoint_worker(rank: int, world: int, folder: str) -> dict:
    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, ampkit.DynamicLossScaler]:
        model = _gpt(seed)
        ampkit.convert_to_fp8(model, ampkit.Fp8Recipe(), process_group=dist.group.WORLD, emulate=True)
        model = fsdp.fully_shard(model, opt_level="O2", dtype=torch.bfloat16, compute="float32")
        optimizer = fsdp.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        return model, optimizer, ampkit.DynamicLossScaler(init_scale=2.0**8, growth_interval=2)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: ampkit.DynamicLossScaler,
              steps: range) -> list[float]:
        losses = []
        for step in steps:
            optimizer.zero_grad(set_to_none=True)
            loss, mean = _rank_step(model, step, rank, world)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(mean)
        return losses

    model, optimizer, scaler = build(0)
    train(model, optimizer, scaler, range(3))
    save_sharded_checkpoint(Path(folder) / "ck", model, optimizer, scaler=scaler, extra={"step": 3})
    saved = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    scale_saved = scaler.get_scale()
    amax = {n: b.clone() for n, b in model.named_buffers() if n.endswith("amax_history")}
    going_on = train(model, optimizer, scaler, range(3, 5))
    model2, optimizer2, scaler2 = build(1)  # other weights: the load must replace them all
    extra = load_sharded_checkpoint(Path(folder) / "ck", model2, optimizer2, scaler=scaler2)
    loaded_amax = {n: b.clone() for n, b in model2.named_buffers() if n.endswith("amax_history")}
    resumed = train(model2, optimizer2, scaler2, range(3, 5))
    return {"going_on": going_on, "resumed": resumed, "extra": extra, "saved": saved, "scale": scaler.get_scale(),
            "scale_saved": scale_saved, "scale2": scaler2.get_scale(), "amax_equal": all(torch.equal(amax[n], loaded_amax[n]) for n in amax),
            "amax_count": len(amax)}


def _errors_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    def refused(call) -> str:  # noqa: ANN001
        try:
            call()
        except (ValueError, RuntimeError) as error:
            return f"{type(error).__name__}: {error}"
        return "accepted"

    out = {}
    model = _gpt()
    params = list(model.parameters())
    out["mesh"] = refused(lambda: fsdp.fully_shard(model, mesh="cpu"))
    out["mesh_2d"] = refused(lambda: fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (1, 2))))
    out["reduce"] = refused(lambda: fsdp.fully_shard(model, reduce_dtype=torch.float64))
    out["predivide"] = refused(lambda: fsdp.fully_shard(model, predivide_factor=0.5))
    out["blocks"] = refused(lambda: fsdp.fully_shard(model, blocks=[nn.Conv2d]))
    out["level"] = refused(lambda: fsdp.fully_shard(model, opt_level="O4"))
    out["half"] = refused(lambda: fsdp.fully_shard(_gpt().bfloat16()))
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    out["optimizer_arg"] = refused(lambda: fsdp.fully_shard(model, optimizer=early))

    class Shared(nn.Module):  # a norm's weight tied to a linear's: O2 would gather it twice
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 8)
            self.proj.bias = self.norm.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(self.norm(x))

    out["shared"] = refused(lambda: fsdp.fully_shard(Shared(), opt_level="O2", dtype=torch.bfloat16))
    out["untouched"] = all(a is b for a, b in zip(params, model.parameters())) and not any(
        isinstance(m, torch.distributed.fsdp.FSDPModule) for m in model.modules())
    fsdp.fully_shard(model, opt_level="O1", dtype=torch.bfloat16, compute="float32")
    out["again"] = refused(lambda: fsdp.fully_shard(model))
    loss, _ = _rank_step(model, 0, rank, world)
    loss.backward()
    out["early_step"] = refused(early.step)
    out["early_prepare"] = refused(lambda: fsdp.prepare_optimizer(model, early))
    from torch.optim import optimizer as optimizer_module  # the refusal is the optimizer's own hook, no global one
    out["global_optimizer_hooks"] = len(optimizer_module._global_optimizer_pre_hooks)
    out["update"] = refused(lambda: fsdp.prepare_optimizer(model, torch.optim.AdamW(model.parameters()), "kahan"))
    out["save_file"] = refused(lambda: ampkit.save_checkpoint("/nonexistent/x.pt", model=model))
    out["plan"] = refused(lambda: ampkit.plan_recompute(model, _global_batch(0)[0][rank::world], 0.5))
    # The way the refusal names: plan the float32 model, apply the plan, then shard: the unplanned losses. The
    # plan as made, then with a segment of both blocks (one FSDP2 unit: the segment runs the second block's forward
    # from the first's, past its gather) and with the whole model.
    policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")
    plan = ampkit.plan_recompute(_gpt(), _global_batch(0)[0][rank::world], 0.5, policy=policy)
    losses = {}
    for name, segments in (("unplanned", None), ("planned", plan.segments), ("both", (("blocks.0", "blocks.1"),)),
                           ("whole", (("",),))):
        planned = _gpt()
        if segments is plan.segments:
            plan.apply(planned)  # as made, selective segments included
        elif segments is not None:
            dataclasses.replace(plan, segments=segments, selective=()).apply(planned)
        planned = fsdp.fully_shard(planned, opt_level="O2", dtype=torch.bfloat16, compute="float32")
        losses[name] = _train(planned, fsdp.prepare_optimizer(planned, torch.optim.AdamW(planned.parameters())),
                              rank, world)
    out["planned_losses"] = losses
    inner = _gpt()  # a segment inside a block: a plan made with other blocks= than fully_shard's
    dataclasses.replace(plan, segments=(("blocks.0.mlp.0", "blocks.0.mlp.1"),), selective=()).apply(inner)
    out["stray"] = refused(lambda: fsdp.fully_shard(inner, opt_level="O2", dtype=torch.bfloat16))
    # A Sequential with a norm among its children and a float32 embedding: the norm is one unit, not two.
    torch.manual_seed(0)
    mixed = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    seen = _record_dtypes(mixed)
    mixed = fsdp.fully_shard(mixed, opt_level="O2", dtype=torch.bfloat16, keep_float32=[nn.Embedding],
                             compute="float32")
    optimizer = fsdp.prepare_optimizer(mixed, torch.optim.SGD(mixed.parameters(), lr=0.1))
    result = mixed(torch.arange(8).view(2, 4))
    result.float().pow(2).mean().backward()
    optimizer.step()
    out["keep_float32"] = (seen, result.dtype, fsdp.sharding(mixed).float32, fsdp.sharding(mixed).blocks)
    # A norm found by behaviour, kept float32 and gathered so, returns its 16-bit input's dtype (as initialize's O2).
    normed = fsdp.fully_shard(nn.Sequential(nn.Linear(8, 8), _RMSNorm(8), nn.Linear(8, 4)), opt_level="O2",
                              dtype=torch.bfloat16, compute="float32")
    dtypes: list[torch.dtype] = []
    normed[1].register_forward_hook(lambda m, args, result: dtypes.append(result.dtype))
    normed(torch.randn(2, 8))
    out["custom_norm"] = (dtypes, fsdp.sharding(normed).float32)
    plain = _gpt()
    torch_fully_shard(plain)
    out["initialize"] = refused(lambda: ampkit.initialize(plain, None, "O2", torch.bfloat16))
    return out


def _pure16_worker(rank: int, world: int) -> dict:
    out = {}
    for update in ("kahan", "stochastic"):
        model = fsdp.fully_shard(_gpt(), opt_level="O3", dtype=torch.bfloat16, compute="float32")
        optimizer = fsdp.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), update)
        losses = _train(model, optimizer, rank, world)
        state = next(iter(optimizer.state.values()))
        out[update] = {"losses": losses, "optimizer": type(optimizer).__name__,
                       "state_types": sorted({type(v).__name__ for v in state.values() if torch.is_tensor(v)})}
    return out


# -- the reference: one process over the same global batches ----------------------------------


def _single_process_losses(level: str, fp8: str | None = None) -> list[float]:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = ampkit.initialize(model, optimizer, level, torch.bfloat16, compute="float32")
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, *_global_batch(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# -- tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def levels() -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_ranks(_levels_worker, 2, timeout_s=240)


def test_each_level_gathers_and_computes_in_its_dtypes(levels: list[dict]) -> None:
    bf16, f32 = torch.bfloat16, torch.float32
    for rank in levels:
        o1, o2, o3 = rank[("O1", f32)], rank[("O2", f32)], rank[("O3", f32)]
        assert o1["seen"]["blocks.0.attn.qkv"] == (f32, bf16)  # float32 weights, autocast computes in bf16
        assert o2["seen"]["blocks.0.attn.qkv"][0] == bf16 and o2["seen"]["lm_head"][0] == bf16
        assert o2["seen"]["blocks.0.ln1"][0] == f32 and o2["seen"]["ln_f"][0] == f32  # norms gathered in float32
        assert o3["seen"]["blocks.0.ln1"][0] == bf16 and o3["param"] == ("DTensor", bf16)
        assert o2["param"] == ("DTensor", f32)  # the float32 shards are the master weights
        assert o2["output"] == f32 and o3["output"] == f32  # the model boundary, as initialize's
        assert o2["blocks"] == ("blocks.0", "blocks.1")
        assert set(o2["float32"]) == {"blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"}


def test_o2_on_two_ranks_matches_o2_in_one_process(levels: list[dict]) -> None:
    reference = _single_process_losses("O2")
    for rank in levels:
        assert rank[("O2", torch.float32)]["losses"] == pytest.approx(reference, rel=1e-3)
        assert rank[("O2", torch.bfloat16)]["losses"] == pytest.approx(reference, rel=1e-2)
    assert levels[0][("O2", torch.float32)]["losses"] == levels[1][("O2", torch.float32)]["losses"]
    assert reference[4] < reference[2] < reference[0]  # it trains (steps 0, 2, 4 see the same batch)
    o1 = _single_process_losses("O1")
    assert levels[0][("O1", torch.float32)]["losses"] == pytest.approx(o1, rel=1e-3)


def test_a_bf16_reduce_sends_half_the_bytes(levels: list[dict]) -> None:
    sent = {dtype: levels[0][("O2", dtype)]["bytes_sent"] for dtype in (torch.float32, torch.bfloat16)}
    assert sent[torch.float32] > 0 and sent[torch.bfloat16] * 2 == sent[torch.float32]


def test_the_estimate_is_within_ten_percent_of_the_measured_per_rank_bytes(levels: list[dict]) -> None:
    x, y = _global_batch(0)
    for level in ("O1", "O2", "O3"):
        estimate = ampkit.estimate_memory(_gpt(), x[:PER_RANK], level, "adamw", torch.bfloat16,
                                          loss_fn=lambda out: out.float().mean(), world_size=2, sharding="fsdp")
        predicted = estimate.mixed.weights + estimate.mixed.gradients + estimate.mixed.optimizer_states
        for rank in levels:
            measured = rank[(level, torch.float32)]["state_bytes"]
            assert abs(predicted - measured) <= 0.10 * measured, (level, predicted, measured)
        whole = ampkit.estimate_memory(_gpt(), x[:PER_RANK], level, "adamw", torch.bfloat16,
                                       loss_fn=lambda out: out.float().mean())
        assert predicted < 0.6 * (whole.mixed.weights + whole.mixed.gradients + whole.mixed.master_weights
                                  + whole.mixed.optimizer_states)
        assert estimate.largest_gather_bytes > 0


def test_an_inf_on_one_rank_makes_both_skip_and_halve_the_scale() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = run_ranks(_scaler_worker, 2, timeout_s=240)
    for kind in ("dynamic", "adaptive"):
        for rank in ranks:
            result = rank[kind]
            assert result["stepped_inf"] is False and result["unchanged"], kind  # rank 1 skipped too
            assert result["skipped"] == 1 and result["stepped"] is True
        assert ranks[0][kind]["scale"] == ranks[1][kind]["scale"]
    assert ranks[0]["dynamic"]["scale"] == 2.0**9
    for rank in ranks:
        assert rank["fp16_reduce"]["overflows"] > 0 and rank["fp16_reduce"]["warned"]
        assert rank["fp16_reduce"]["stepped"] is False
    for rank in ranks:  # the global norm of the sharded gradients, as the gathered gradients give it
        result = rank["dynamic"]
        assert result["norm"] == pytest.approx(result["full_norm"], rel=1e-5)
        assert result["clipped"] == pytest.approx(1e-3, rel=1e-2)


def test_fp8_on_shards_delayed_amaxes_agree_and_fp8_all_gathers_match_one_process() -> None:
    pytest.importorskip("torchao.float8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = run_ranks(_fp8_worker, 2, timeout_s=240)
        single = _current_fp8(0, 1, fsdp_all_gather=False)
    delayed = [rank["delayed"] for rank in ranks]
    assert delayed[0] and set(delayed[0]) == set(delayed[1])
    for name in delayed[0]:
        assert torch.equal(delayed[0][name], delayed[1][name]), name
        assert delayed[0][name].abs().sum() > 0
        single_o2 = _fp8_gathers_o2(0, 1)
    for rank in ranks:
        for case in ("current", "current_o2"):
            assert rank[case]["weight_type"] == "WeightWithDynamicFloat8CastTensor", case  # FP8 all-gather in use
        assert rank["current"]["losses"] == pytest.approx(single["losses"], rel=1e-3)
        # the FP8 all-gather casts the float32 shards to FP8, one process at O2 its bfloat16 weights: within 1%
        assert rank["current_o2"]["losses"] == pytest.approx(single_o2["losses"], rel=1e-2)
        assert "opt_level='O3'" in rank["o3"] and "fsdp_all_gather=False" in rank["o3"] and rank["o3_untouched"]


def test_a_sharded_checkpoint_resumes_bit_identically_and_loads_into_one_process(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = run_ranks(_checkpoint_worker, 2, str(tmp_path), timeout_s=240)
    for rank in ranks:
        assert rank["resumed"] == rank["going_on"]  # bit-identical, FP8 amaxes and the scaler included
        assert rank["extra"] == {"step": 3} and rank["scale"] == rank["scale2"]
        assert rank["amax_equal"] and rank["amax_count"] > 0
    assert not list(tmp_path.glob(".ck.partial-*"))
    # Resharded: the 2-rank checkpoint into one process, a plain (unsharded) model.
    model = _gpt(7)
    ampkit.convert_to_fp8(model, ampkit.Fp8Recipe(), emulate=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ampkit.DynamicLossScaler()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = load_sharded_checkpoint(tmp_path / "ck", model, optimizer, scaler=scaler)
    assert extra == {"step": 3} and scaler.get_scale() == ranks[0]["scale_saved"] != 2.0**16
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ranks[0]["saved"][name]), name
    assert len(optimizer.state) == len(list(model.parameters()))


def test_bad_calls_are_refused_in_one_line_and_change_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = run_ranks(_errors_worker, 2, timeout_s=240)[0]
    expected = {
        "mesh": "ValueError: mesh='cpu' is a str, not a DeviceMesh",
        "mesh_2d": "ValueError: mesh has 2 dimensions",
        "reduce": "ValueError: reduce_dtype=torch.float64 is invalid: choose torch.float32, torch.bfloat16",
        "predivide": "ValueError: predivide factor 0.5 is outside [1, world_size=2]",
        "blocks": "ValueError: blocks=['Conv2d'] matches no module of the model",
        "level": "ValueError: Unknown opt_level: 'O4'",
        "half": "ValueError: The model's parameters are ['torch.bfloat16']: pass the float32 model",
        "optimizer_arg": "RuntimeError: fully_shard(optimizer=...): build the optimizer after sharding",
        "shared": "ValueError: 'proj.bias' is shared between 'norm' and 'the root'",
        "again": "ValueError: FSDPGPT is sharded already",
        "early_step": "RuntimeError: SGD was built before ampkit.distributed.fully_shard",
        "early_prepare": "RuntimeError: SGD was built before ampkit.distributed.fully_shard",
        "update": "ValueError: update='kahan' applies at O3 only",
        "save_file": "ValueError: states['model']['tok.weight'] is a DTensor (an FSDP2 shard)",
        "plan": "ValueError: plan_recompute measures a model in one process, and this one is sharded by FSDP2",
        "stray": "ValueError: The model's recompute plan runs ['blocks.0.mlp.0', 'blocks.0.mlp.1'] in a segment of "
                 "several blocks, but they are not the blocks fully_shard shards (['blocks.0', 'blocks.1'])",
        "initialize": "ValueError: The model is sharded with FSDP2 already",
    }
    for key, start in expected.items():
        assert out[key].startswith(start), (key, out[key])
        assert "\n" not in out[key], key
    assert out["untouched"] is True and out["global_optimizer_hooks"] == 0
    losses = out["planned_losses"]
    assert losses["planned"] == losses["both"] == losses["whole"] == losses["unplanned"]
    seen, output, kept, blocks = out["keep_float32"]
    assert seen["1"] == (torch.bfloat16, torch.bfloat16) and seen["3"][0] == torch.bfloat16
    assert seen["2"][0] == torch.float32 and output == torch.float32
    assert kept == ("0", "2") and blocks == ("1", "3")
    assert out["custom_norm"] == ([torch.bfloat16], ("1",))


def test_o3_updates_kahan_and_stochastic_on_shards() -> None:
    pytest.importorskip("optimi")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = run_ranks(_pure16_worker, 2, timeout_s=240)
    for update in ("kahan", "stochastic"):
        losses = ranks[0][update]["losses"]
        assert losses == ranks[1][update]["losses"] and losses[-1] < losses[0]
        assert ranks[0][update]["state_types"] == ["DTensor"]  # states sharded as their weights: checkpointable
    assert ranks[0]["stochastic"]["optimizer"] == "StochasticRoundingOptimizer"


def test_without_a_process_group_fully_shard_says_how_to_start_one() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node N"):
        fsdp.fully_shard(_gpt())
