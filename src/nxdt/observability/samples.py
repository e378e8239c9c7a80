"""Samples during training (`exp_manager.samples`): the model continues a few prompts every N steps,
and the text goes to TensorBoard's text tab (`samples/<i>`) and the log.

Every rank runs the same decoding on its part of the model, so it works with any layout whose ranks
each run whole forward passes: data parallel (DDP, ZeRO-1), FSDP (parameters gathered per layer as in
training), tensor parallelism (logits gathered) and expert parallelism. Pipelines and context
parallelism are refused by validation (nxdt.spec.exp). The generation loop and the KV
cache are `nxdt generate`'s (nxdt.inference.generate), under the run's precision (autocast).

Greedy by default: the same prompt at each interval shows how the model changes, not the dice.
"""

from __future__ import annotations

import sys

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from nxdt.config.errors import ConfigError
from nxdt.inference.generate import SamplingParams, generate


class SampleGenerator(Callback):
    def __init__(self, cfg, tokenizer, model_vocab_size: int | None) -> None:
        s = cfg.exp_manager.samples
        self.samples = s
        self.tokenizer = tokenizer
        context = cfg.model.encoder_seq_length or cfg.data.seq_length or 0
        self.prompt_ids = [tokenizer(p)["input_ids"] for p in s.prompts]
        longest = max(len(p) for p in self.prompt_ids)
        if context and longest >= context:
            raise ConfigError(f"exp_manager.samples.prompts: a prompt is {longest} tokens, not shorter than "
                              f"the model's sequence length {context}")
        if model_vocab_size is not None and len(tokenizer) > model_vocab_size:
            raise ConfigError(f"exp_manager.samples: the tokenizer ({len(tokenizer)} tokens) is larger than the "
                              f"model's vocabulary ({model_vocab_size})")
        self.max_new_tokens = min(s.max_new_tokens, context - longest) if context else s.max_new_tokens
        self.params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=s.temperature,
                                     top_k=s.top_k, top_p=s.top_p, seed=s.seed, vocab_size=len(tokenizer),
                                     eos_token_id=tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self._last_step = -1
        ds = cfg.distributed_strategy
        # sequence parallelism splits the sequence over the tp ranks: whole multiples of tp, recomputed
        self.length_multiple = ds.tensor_model_parallel_size if ds.sequence_parallel else 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self.samples.every_n_train_steps
        if every and trainer.global_step % every == 0:
            self.sample(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._last_step:
            self.sample(trainer, pl_module)

    @torch.no_grad()
    def sample(self, trainer, pl_module) -> list[str]:
        """Generate on every rank (a collective under FSDP/TP); rank 0 logs. Returns the texts."""
        step = trainer.global_step
        self._last_step = step
        model = pl_module.model
        was_training = model.training
        model.eval()  # no dropout; the training step puts it back in train mode
        try:
            with pl_module._autocast():
                outputs = generate(model, self.prompt_ids, self.params, pad_id=self.pad_id,
                                   length_multiple=self.length_multiple)
        finally:
            model.train(was_training)
        texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
        if trainer.is_global_zero:
            for i, (prompt, text) in enumerate(zip(self.samples.prompts, texts)):
                print(f"sample step {step} [{i}]: {prompt}{text}", file=sys.stdout, flush=True)
                for logger in trainer.loggers:
                    if isinstance(logger, TensorBoardLogger):
                        # markdown: the prompt in bold, so the continuation stands out
                        logger.experiment.add_text(f"samples/{i}", f"**{_md(prompt)}**{_md(text)}", global_step=step)
        return texts


def _md(text: str) -> str:
    """Text as it reads in TensorBoard's markdown view (line breaks kept, markup characters escaped)."""
    for ch in "\\*_`#[]<>":
        text = text.replace(ch, "\\" + ch)
    return text.replace("\n", "  \n")
