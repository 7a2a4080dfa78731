"""Train a small transformers Llama with its own Trainer, at ampkit's O1 or O2, in bfloat16 or float16.

    python examples/trainer_llama.py --opt-level O2 --dtype fp16 --steps 20

The recipe: ampkit prepares the model and its optimizer, the Trainer trains them as given.

    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr), "O2", torch.float16)
    trainer = Trainer(model=model, args=TrainingArguments(..., bf16=False, fp16=False),
                      train_dataset=dataset, optimizers=(optimizer, None))
    install_scaler(trainer.accelerator, ampkit.DynamicLossScaler())  # float16 only: before train()

Leave the Trainer's own ``bf16`` / ``fp16`` off: ampkit does the casting (O1: its policy around the forward;
O2: a 16-bit model with float32 master weights, norms and buffers in float32, float32 logits). The Trainer
builds its learning-rate schedule on the optimizer it is given, master weights included. float16 needs loss
scaling: ``install_scaler`` makes ampkit's scaler the one of the Accelerator the Trainer drives, so its backward
scales, its gradient clipping sees unscaled gradients, a step with inf/NaN gradients is skipped (and its
learning-rate step with it) and the Trainer's checkpoints keep the scaler. The model is built from a config with
random weights, the data is the standard library's source text (``ampkit compare``'s text), nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import ampkit
from ampkit.experiment.data import load, windows
from ampkit.integrations.accelerate import install_scaler

CONTEXT = 64


class TextWindows(torch.utils.data.Dataset):
    """Fixed windows of the text, each its own labels (transformers' causal LMs shift them)."""

    def __init__(self, count: int, seed: int = 0) -> None:
        stream = load("text").train_x
        starts = torch.randint(0, len(stream) - CONTEXT - 1, (count,), generator=torch.Generator().manual_seed(seed))
        self.inputs, _ = windows(stream, starts, CONTEXT)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.inputs[i], "labels": self.inputs[i]}


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=CONTEXT,
                         use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def train(model: torch.nn.Module, opt_level: str, steps: int, out: str, dtype: torch.dtype = torch.bfloat16,
          scaler: ampkit.DynamicLossScaler | None = None) -> tuple[list[float], Trainer]:
    """The Trainer's logged losses, every 5 steps, and the Trainer; ``opt_level`` ``"fp32"`` trains without
    ampkit; float16 with ``scaler`` (default ``ampkit.DynamicLossScaler()``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if opt_level != "fp32":
        model, optimizer = ampkit.initialize(model, optimizer, opt_level, dtype=dtype)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8, use_cpu=True,
                             report_to=[], logging_steps=5, save_strategy="no", seed=0, data_seed=0,
                             disable_tqdm=True, bf16=False, fp16=False)
    trainer = Trainer(model=model, args=args, train_dataset=TextWindows(8 * steps), optimizers=(optimizer, None))
    if opt_level != "fp32" and dtype == torch.float16:
        install_scaler(trainer.accelerator, scaler or ampkit.DynamicLossScaler())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], trainer


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O1", "O2"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="trainer-llama", help="the Trainer's output directory")
    args = parser.parse_args(argv)
    model = llama()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    label = f"{args.dtype} {args.opt_level}"
    losses = {"fp32": train(copy.deepcopy(model), "fp32", args.steps, f"{args.out}/fp32")[0],
              label: train(model, args.opt_level, args.steps, f"{args.out}/{args.opt_level}", dtype)[0]}
    for name, values in losses.items():
        print(f"{name}: " + " ".join(f"{v:.3f}" for v in values))
    return losses


if __name__ == "__main__":
    main()
