"""The plain Hugging Face Trainer script that cptune at cp=1 is compared with.

What a user would write without cptune: load the model with ``sdpa`` attention,
wrap it in the same LoRA adapter with peft, pad each batch of rows to its
longest row, and let the model compute its own loss from ``labels``. The rows are
the ones cptune prepared (tokenized and packed) for the same recipe, read with
``datasets.load_from_disk``, so both runs train on identical batches; data
preparation is not part of the timed steps of either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def pad_rows(rows: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest; padding gets label -100 and positions 0..p-1 (its own document)."""
    length = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    position_ids = torch.arange(length).repeat(len(rows), 1)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[b, :n] = torch.tensor(row["input_ids"])
        labels[b, :n] = torch.tensor(row["labels"])
        position_ids[b, :n] = torch.tensor(row["position_ids"])
        position_ids[b, n:] = torch.arange(length - n)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def train_plain(recipe: Any, train_rows: Path, output_dir: Path, callbacks: list[Any]) -> None:
    """Train as ``recipe`` says (cp=1, LoRA) with nothing but transformers, peft and datasets."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(
        recipe.base_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    torch.manual_seed(recipe.seed)
    model = get_peft_model(
        model,
        LoraConfig(
            r=recipe.lora_r,
            lora_alpha=recipe.lora_alpha,
            lora_dropout=recipe.lora_dropout,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
    )
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=recipe.micro_batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        max_steps=recipe.max_steps,
        learning_rate=recipe.learning_rate,
        optim=recipe.optimizer,
        lr_scheduler_type=recipe.lr_scheduler,
        warmup_steps=recipe.warmup_steps or 0,
        weight_decay=recipe.weight_decay,
        max_grad_norm=recipe.max_grad_norm or 0.0,
        seed=recipe.seed,
        data_seed=recipe.seed,
        logging_steps=recipe.logging_steps,
        logging_first_step=True,
        save_strategy="no",
        report_to="none",
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
        bf16=recipe.bf16 is True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=datasets.load_from_disk(str(train_rows)),
        data_collator=pad_rows,
        callbacks=callbacks,
    )
    trainer.train()
