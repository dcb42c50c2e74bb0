"""A tiny LlamaForCausalLM and Trainer runs for tests/integrations/test_hf.py."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments


def tiny_llama(hidden: int = 32, layers: int = 2, vocab: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16, vocab: int = 64):
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):
    """Ends training after ``step`` (an interrupted run: the schedule still plans max_steps)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def arguments(output_dir, max_steps: int = 8, save_steps: int = 2, save_total_limit: int | None = 2,
              **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, save_steps=save_steps,
                             save_strategy="steps", save_total_limit=save_total_limit, per_device_train_batch_size=4,
                             learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, logging_strategy="no",
                             report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
                             disable_tqdm=True, **kwargs)


def trainer(output_dir, callbacks=(), **kwargs) -> Trainer:
    return Trainer(model=tiny_llama(), args=arguments(output_dir, **kwargs), train_dataset=Tokens(),
                   callbacks=list(callbacks))


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
