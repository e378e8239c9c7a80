"""What NxdtLightningModule does differently for GRPO (model_alignment_strategy.grpo).

A checkpoint between the num_iterations updates of one batch of rollouts carries that batch in each
rank's state (`grpo_save_state`), so the resumed steps train on the same completions.

The optimizer step is the same `train_step`; before it, a step samples its rollouts
(nxdt.rl.rollout: every num_iterations steps, reused in between with their old log-probs), and its
forward/backward is GRPO's (nxdt.rl.step). Logged each step (the mean over the data-parallel ranks,
or computed on the whole gathered batch):

    reward, reward_std                     the weighted total: mean and std over the step's completions
    rewards/<function>/mean, /std          each reward function's
    kl                                     mean per-token KL to the reference (beta > 0)
    clip_ratio                             share of completion tokens whose ratio was clipped
    entropy                                mean per-token entropy of the policy
    completions/mean_length, /max_length, /clipped_ratio (the truncated share, TRL's name)
    tokens_per_s/rollout, tokens_per_s/train  generated tokens per second of sampling, and completion
                                           tokens per second of the training forward/backward
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist

from nxdt.config.errors import ConfigError
from nxdt.data.prompts import read_prompt_rows
from nxdt.models.lora import adapters_disabled
from nxdt.parallel.mesh import submesh
from nxdt.rl.rewards import RewardError, load_reward_funcs, reward_name
from nxdt.rl.rollout import (ReferenceWeights, RolloutOptions, forward_logps, rollout, rollout_from_state,
                             rollout_state)
from nxdt.rl.step import GRPOForwardBackward, LossOptions
from nxdt.spec.alignment import scale_rewards_of


def _gather_over(group):
    def gather(local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    return gather


def _std(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.std()) if x.numel() > 1 else 0.0


def check_grpo_inputs(spec) -> None:
    """Pre-flight (before anything is written): every reward function imports, and the prompt file's
    first rows have a usable `prompt`. ConfigError naming the path otherwise."""
    g = spec.alignment.grpo
    if g is None:
        return
    load_reward_funcs(g.reward_funcs)
    # a missing file is nxdt.spec.paths' to report (`nxdt plan` lists the paths as not checked)
    if g.task is None and os.path.exists(os.path.expanduser(str(spec.cfg.data.train_dir))):
        limit = spec.cfg.data.dev_choose_samples
        read_prompt_rows(spec.cfg.data.train_dir, min(limit or 100, 100))


def grpo_summary(cfg, layout, g, lora: bool, reference_bytes: int, vocab_size: int | None = None) -> str:
    """The start summary's GRPO line: completions per step and per rank, and the memory the rollouts
    add per rank (the KV cache of one rank's completions at full length, their last-position logits,
    and the reference's weight copy)."""
    m = cfg.model
    prompts = layout.global_batch_size // g.num_generations
    local = layout.global_batch_size // max(layout.dp, 1)
    heads = m.num_attention_heads or 1
    kv_heads = -(-(m.num_kv_heads or heads) // max(layout.tp, 1))  # this rank's K/V heads (tensor parallel)
    head_dim = (m.hidden_size or 0) // heads
    kv = 2 * (m.num_layers or 0) * kv_heads * head_dim * layout.seq_length * local * 4  # fp32 upper bound
    logits = local * (vocab_size or 0) * 4 * 2  # one step's last-position logits and probabilities, fp32
    reference = ("none (beta 0)" if g.beta == 0 else "the base, adapters off (no copy)" if lora
                 else f"a copy of the starting weights, {reference_bytes / 2**20:.1f} MiB")
    return (f"  grpo         {prompts} prompts x {g.num_generations} = {layout.global_batch_size} completions/step "
            f"({local} per rank), up to {g.max_completion_length} new tokens each; rollouts need ~"
            f"{(kv + logits) / 2**20:.1f} MiB per rank (KV cache and logits, fp32 bound); reference: {reference}")


class GRPOSteps:
    """Mixed into NxdtLightningModule (it provides cfg, alignment, model, precision, layout, trainer)."""

    _grpo_rollout = None
    _grpo_rollout_step = -1
    _grpo_reference = None
    _grpo_funcs = None

    def grpo_start(self) -> None:
        """On train start: the reward functions, and the reference weights (beta > 0 without LoRA)."""
        g = self.alignment.grpo
        if g is None:
            return
        self._grpo_funcs = load_reward_funcs(g.reward_funcs)
        if g.beta > 0 and self.alignment.peft is None:
            if self.global_step > 0:
                raise ConfigError("model_alignment_strategy.grpo.beta > 0 without peft: resuming is not supported yet "
                                  "(the reference, the starting weights, is not in the checkpoint)")
            self._grpo_reference = ReferenceWeights(self.model)
        if self.global_rank == 0:
            print(grpo_summary(self.cfg, self.layout, g, self.alignment.peft is not None,
                               sum(t.numel() * t.element_size() for t in self._grpo_reference.saved)
                               if self._grpo_reference is not None else 0, self.vocab_size), flush=True)

    def grpo_save_state(self, checkpoint: dict) -> None:
        """A checkpoint between the num_iterations of one batch of rollouts keeps that batch (this
        rank's rows, old and reference log-probs): the resumed steps train on the same completions
        (sampling again would use the updated weights)."""
        g, r = self.alignment.grpo, self._grpo_rollout
        if g is None or r is None or self.global_step % g.num_iterations == 0:
            return
        if self._grpo_rollout_step != self.global_step - self.global_step % g.num_iterations:
            return
        dp = submesh(self.device_mesh, "dp")
        checkpoint["grpo_rollout"] = {"step": self._grpo_rollout_step, "dp": [dp.get_local_rank(), dp.size()],
                                      **rollout_state(r)}

    def grpo_load_state(self, checkpoint: dict) -> None:
        saved = checkpoint.pop("grpo_rollout", None)
        if saved is None or self.alignment.grpo is None:
            return
        dp = submesh(self.device_mesh, "dp")
        if list(saved.pop("dp")) != [dp.get_local_rank(), dp.size()]:
            raise ConfigError(f"resuming at step {checkpoint.get('global_step')}, between the num_iterations of the "
                              f"rollouts sampled at step {saved['step']}, on another data-parallel size is not "
                              "supported yet: resume on the saved layout, or from a checkpoint at a multiple of "
                              "model_alignment_strategy.grpo.num_iterations")
        self._grpo_rollout_step = int(saved.pop("step"))
        self._grpo_rollout = rollout_from_state(saved, self.device)

    def _grpo_options(self) -> RolloutOptions:
        g, dm = self.alignment.grpo, self.trainer.datamodule
        tok = dm.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return RolloutOptions(
            num_generations=g.num_generations, max_completion_length=g.max_completion_length,
            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, seq_length=int(self.cfg.data.seq_length),
            scale_rewards=scale_rewards_of(g), mask_truncated=g.mask_truncated_completions,
            reward_weights=list(g.reward_weights or [1.0] * len(g.reward_funcs)), eos_token_id=tok.eos_token_id,
            pad_id=int(pad or 0), vocab_size=len(tok), seed=int(self.cfg.seed), tp=self.layout.tp,
            length_multiple=self.layout.tp if self.cfg.distributed_strategy.sequence_parallel else 1,
            compile_decode=bool(g.compile_decode))

    def _grpo_new_rollout(self, batch, step: int):
        g = self.alignment.grpo
        dp = submesh(self.device_mesh, "dp")
        autocast = lambda: self.precision.autocast(self.device.type)  # noqa: E731
        try:
            r = rollout(self.model, batch["rows"], step, self._grpo_options(), self._grpo_funcs,
                        tokenizer=self.trainer.datamodule.tokenizer, dp_rank=dp.get_local_rank(), dp_size=dp.size(),
                        gather=_gather_over(dp.get_group()) if dp.size() > 1 else None, autocast=autocast,
                        row_ids=[int(i) for i in batch["index"]])
        except RewardError as err:
            raise ConfigError(str(err)) from None
        mbs = self.layout.micro_batch_size
        if g.num_iterations > 1:  # the old policy: these weights, before the rollout's first update
            r.old_logps = forward_logps(self.model, r.input_ids, r.labels, g.temperature, micro_batch_size=mbs,
                                        autocast=autocast, tp=self.layout.tp)
        if g.beta > 0:
            with (adapters_disabled(self.model) if self.alignment.peft is not None
                  else self._grpo_reference.swapped(self.model)):
                r.ref_logps = forward_logps(self.model, r.input_ids, r.labels, g.temperature, micro_batch_size=mbs,
                                            autocast=autocast, tp=self.layout.tp)
        return r

    def grpo_forward_backward(self, batch) -> GRPOForwardBackward:
        g = self.alignment.grpo
        rollout_step = self.global_step - self.global_step % g.num_iterations
        fresh = self._grpo_rollout is None or self._grpo_rollout_step != rollout_step
        if fresh:
            self._grpo_rollout = self._grpo_new_rollout(batch, rollout_step)
            self._grpo_rollout_step = rollout_step
        options = LossOptions(g.loss_type, g.epsilon, g.epsilon_high, g.beta, g.temperature, g.max_completion_length,
                              tp=self.layout.tp)
        fb = GRPOForwardBackward(self.model, self.precision, self._grpo_rollout, options,
                                 num_microbatches=self.layout.num_microbatches, backward=self.manual_backward,
                                 device_type=self.device.type)
        fb.step, fb.fresh = self.global_step, fresh  # the step before train_step counts it (what the logs say)
        return fb

    def log_grpo_metrics(self, fb: GRPOForwardBackward) -> None:
        r, g = fb.rollout, self.alignment.grpo
        sums = torch.stack([fb.sums[k] for k in ("kl", "clipped", "entropy", "tokens")]).to(torch.float64)
        times = torch.tensor([fb.seconds, r.seconds], dtype=torch.float64)
        dp = submesh(self.device_mesh, "dp")
        if dp.size() > 1:
            dist.all_reduce(sums, group=dp.get_group())
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=dp.get_group())
        kl, clipped, entropy, tokens = sums.tolist()
        log = self.log_step_scalar
        log("reward", float(torch.nanmean(r.total)), prog_bar=True)
        log("reward_std", _std(r.total))
        for f, fn in enumerate(self._grpo_funcs):
            log(f"rewards/{reward_name(fn)}/mean", float(torch.nanmean(r.rewards[:, f])))
            log(f"rewards/{reward_name(fn)}/std", _std(r.rewards[:, f]))
        if g.beta > 0:
            log("kl", kl / max(tokens, 1.0))
        log("clip_ratio", clipped / max(tokens, 1.0))
        log("entropy", entropy / max(tokens, 1.0))
        log("completions/mean_length", float(r.lengths.mean()))
        log("completions/max_length", float(r.lengths.max()))
        log("completions/clipped_ratio", float(r.truncated.float().mean()))
        fresh = fb.fresh
        if fresh and times[1] > 0:
            log("tokens_per_s/rollout", float(r.lengths.sum()) / float(times[1]))
        if times[0] > 0:
            log("tokens_per_s/train", float(r.lengths.sum()) / float(times[0]))
        every = g.log_completions_every_n_steps
        if every and fb.step % every == 0 and fresh:
            self._log_completions(r, fb.step + 1)  # numbered by the optimizer steps done, as the scalars

    def _log_completions(self, r, step: int, rows: int = 3) -> None:
        """A few of this step's prompt / completion / reward rows to stdout and TensorBoard's text tab."""
        if self.global_rank != 0:
            return
        lines = []
        for i in range(min(rows, len(r.completions))):
            reward = float(r.total[i])
            lines.append(f"prompt: {r.prompts[i]!s} | completion: {r.completions[i]!r} | "
                         f"reward: {'nan' if math.isnan(reward) else f'{reward:.3f}'}")
        print(f"GRPO step {step}:\n  " + "\n  ".join(lines), file=sys.stdout, flush=True)
        for logger in self.trainer.loggers:
            add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
            if add_text is not None and type(logger).__name__ == "TensorBoardLogger":
                add_text("grpo/completions", "\n\n".join(lines), global_step=step)
