"""Config names of TRL, verl, OpenRLHF and LightRFT, and the lmrl field each one is.

A user coming from another framework writes its names first (`learning_rate=1e-6`, `beta=0.04`,
`actor_rollout_ref.rollout.n=8`). lmrl does not accept them as aliases (one name per field keeps
configs greppable); instead the error names lmrl's field:

    lmrl: error: learning_rate is TRL's name; lmrl calls it optim.lr

TRL's GRPOConfig, OpenRLHF's command-line flags and LightRFT's arguments are flat names, recognised wherever they appear
(`learning_rate=` or `optim.learning_rate=`); verl's are dotted paths, recognised as written.
docs/coming-from-trl.md shows the same table; a test keeps the two in step.
"""

from __future__ import annotations

from typing import Any

# flat name -> (framework, lmrl's field, a note when the meaning differs)
FLAT_NAMES: dict[str, tuple[str, str, str]] = {
    # TRL GRPOConfig (and the TrainingArguments it extends)
    "learning_rate": ("TRL", "optim.lr", ""),
    "num_generations": ("TRL", "rollout.group_size", ""),
    "beta": ("TRL", "algorithm.kl_coef", ""),
    "max_completion_length": ("TRL", "rollout.max_new_tokens", ""),
    "max_prompt_length": ("TRL", "rollout.max_prompt_length", "lmrl refuses longer prompts instead of cutting them"),
    "loss_type": ("TRL", "algorithm.aggregation", "grpo = seq-mean-token-mean, dr_grpo = seq-mean-token-sum-norm, "
                  "dapo / bnpo = token-mean; or pick a whole preset with algorithm.name"),
    "scale_rewards": ("TRL", "algorithm.advantage", "scale_rewards=false is algorithm.advantage=dr_grpo"),
    "epsilon": ("TRL", "algorithm.clip_low", ""),
    "epsilon_high": ("TRL", "algorithm.clip_high", ""),
    "num_iterations": ("TRL", "algorithm.num_iterations", ""),
    "steps_per_generation": ("TRL", "algorithm.num_minibatches", "optimizer steps per batch of generations"),
    "temperature": ("TRL", "rollout.temperature", ""),
    "top_p": ("TRL", "rollout.top_p", ""),
    "top_k": ("TRL", "rollout.top_k", ""),
    "per_device_train_batch_size": ("TRL", "rollout.prompts_per_step",
                                    "lmrl counts prompts; each gets rollout.group_size completions"),
    "gradient_accumulation_steps": ("TRL", "optim.micro_batch_size",
                                    "lmrl accumulates by itself: micro_batch_size only bounds memory"),
    "max_steps": ("TRL", "train.steps", ""),
    "teacher_model_name_or_path": ("TRL", "algorithm.teacher", "TRL's GKDTrainer; lmrl distils on-policy with the "
                                   "reverse KL (GKD's lmbda=1, beta=1), estimated on the sampled tokens"),
    "num_train_epochs": ("TRL", "train.steps", "lmrl counts steps, not epochs"),
    "seed": ("TRL", "train.seed", ""),
    "output_dir": ("TRL", "train.output_dir", ""),
    "logging_steps": ("TRL", "log.every", ""),
    "save_steps": ("TRL", "train.save_every", ""),
    "save_total_limit": ("TRL", "train.keep_last", ""),
    "load_best_model_at_end": ("TRL", "train.keep_best", "the best eval/accuracy's model is written to best/; final/ "
                               "stays the last step's"),
    "eval_steps": ("TRL", "train.eval_every", ""),
    "resume_from_checkpoint": ("TRL", "train.resume", ""),
    "warmup_steps": ("TRL", "optim.warmup_steps", ""),
    "lr_scheduler_type": ("TRL", "optim.schedule", ""),
    "weight_decay": ("TRL", "optim.weight_decay", ""),
    "max_grad_norm": ("TRL", "optim.max_grad_norm", ""),
    "adam_beta1": ("TRL", "optim.betas", "optim.betas=[beta1, beta2]"),
    "adam_beta2": ("TRL", "optim.betas", "optim.betas=[beta1, beta2]"),
    "gradient_checkpointing": ("TRL", "model.gradient_checkpointing", ""),
    "padding_free": ("TRL", "train.packing", "on by default in lmrl"),
    "bf16": ("TRL", "train.autocast_bf16", "or model.dtype=bfloat16 for the weights themselves"),
    "torch_dtype": ("TRL", "model.dtype", ""),
    "model_name_or_path": ("TRL", "model.name_or_path", ""),
    "dataset_name": ("TRL", "data.path", ""),
    "reward_weights": ("TRL", "reward.weights", ""),
    "mask_truncated_completions": ("TRL", "reward.drop_truncated", ""),
    "top_entropy_quantile": ("TRL", "algorithm.entropy_top_fraction", ""),
    "importance_sampling_level": ("TRL", "algorithm.ratio_level", ""),
    "log_completions": ("TRL", "log.samples_every", "the steps between sample tables (0 = none)"),
    "num_completions_to_print": ("TRL", "log.num_samples", ""),
    "report_to": ("TRL", "log.wandb", "or log.tensorboard; metrics.jsonl is always written"),
    "use_peft": ("TRL", "model.lora", "model.lora={} turns LoRA on"),
    "lora_r": ("TRL", "model.lora.r", ""),
    "lora_alpha": ("TRL", "model.lora.alpha", ""),
    "lora_dropout": ("TRL", "model.lora.dropout", ""),
    "lora_target_modules": ("TRL", "model.lora.target_modules", ""),
    "disable_dropout": ("TRL", "model.dropout", "the opposite sense: dropout is off unless model.dropout=true"),
    # OpenRLHF's command-line flags (train_ppo_ray)
    "pretrain": ("OpenRLHF", "model.name_or_path", ""),
    "critic_pretrain": ("OpenRLHF", "model.critic_name_or_path", ""),
    "prompt_data": ("OpenRLHF", "data.path", ""),
    "input_key": ("OpenRLHF", "data.prompt_column", ""),
    "actor_learning_rate": ("OpenRLHF", "optim.lr", ""),
    "critic_learning_rate": ("OpenRLHF", "optim.critic_lr", ""),
    "n_samples_per_prompt": ("OpenRLHF", "rollout.group_size", ""),
    "rollout_batch_size": ("OpenRLHF", "rollout.prompts_per_step", ""),
    "micro_train_batch_size": ("OpenRLHF", "optim.micro_batch_size", ""),
    "train_batch_size": ("OpenRLHF", "algorithm.num_minibatches", "lmrl counts minibatches per batch"),
    "max_epochs": ("OpenRLHF", "algorithm.num_iterations", ""),
    "num_episodes": ("OpenRLHF", "train.steps", "lmrl counts steps"),
    "prompt_max_len": ("OpenRLHF", "rollout.max_prompt_length", ""),
    "generate_max_len": ("OpenRLHF", "rollout.max_new_tokens", ""),
    "init_kl_coef": ("OpenRLHF", "algorithm.kl_coef", ""),
    "kl_target": ("OpenRLHF", "algorithm.kl_target", ""),
    "kl_estimator": ("OpenRLHF", "algorithm.kl_estimator", ""),
    "use_kl_loss": ("OpenRLHF", "algorithm.kl_in", "use_kl_loss is algorithm.kl_in=loss"),
    "async_queue_size": ("OpenRLHF", "train.max_staleness", "OpenRLHF counts batches the generator may run ahead; lmrl "
                         "bounds how many versions old any group trained on may be (train.async_steps: a fixed lag)"),
    "eps_clip": ("OpenRLHF", "algorithm.clip_low", "and algorithm.clip_high"),
    "eps_clip_low_high": ("OpenRLHF", "algorithm.clip_low", "and algorithm.clip_high"),
    "value_clip": ("OpenRLHF", "algorithm.value_clip", ""),
    "advantage_estimator": ("OpenRLHF", "algorithm.advantage", "or a whole preset with algorithm.name"),
    "entropy_loss_coef": ("OpenRLHF", "algorithm.entropy_coef", ""),
    "normalize_reward": ("OpenRLHF", "reward.normalize", ""),
    "reward_clip_range": ("OpenRLHF", "reward.clip", "reward.clip=[low, high]; a number c means [-c, c]"),
    "save_path": ("OpenRLHF", "train.output_dir", ""),
    "lr_warmup_ratio": ("OpenRLHF", "optim.warmup_steps", "lmrl counts warm-up in steps"),
    # LightRFT (its experience maker's arguments)
    "reward_recipe": ("LightRFT", "reward.recipes", "label -> reward functions written as in reward.functions, "
                      "each with its weight; reward.recipe_column=label names the label column"),
    "reward_fn_label_map": ("LightRFT", "reward.recipes", "each label's reward functions are its recipe"),
}

# verl's dotted paths (its Hydra config, as written on its command line) -> (lmrl's field, note)
VERL_PATHS: dict[str, tuple[str, str]] = {
    "actor_rollout_ref.model.path": ("model.name_or_path", ""),
    "actor_rollout_ref.actor.optim.lr": ("optim.lr", ""),
    "actor_rollout_ref.rollout.n": ("rollout.group_size", ""),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", ""),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", ""),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("algorithm.num_minibatches", "lmrl counts minibatches per batch"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("optim.micro_batch_size", ""),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("optim.micro_batch_tokens", ""),
    "actor_rollout_ref.actor.use_dynamic_bsz": ("optim.micro_batch_tokens", "set a token budget: use_dynamic_bsz=true"),
    "async_training.staleness_threshold": ("train.max_staleness", "verl's is the fraction of a batch that may be stale; "
                                           "lmrl's the most versions any group trained on may be behind"),
    "async_training.partial_rollout": ("rollout.partial", "true prefills the rows in flight again under new weights, "
                                       "as verl does; keep_cache keeps their cache (PipelineRL)"),
    "actor_rollout_ref.model.use_remove_padding": ("train.packing", "on by default in lmrl"),
    "actor_rollout_ref.actor.ppo_epochs": ("algorithm.num_iterations", ""),
    "actor_rollout_ref.actor.clip_ratio": ("algorithm.clip_low", "and algorithm.clip_high"),
    "actor_rollout_ref.actor.clip_ratio_low": ("algorithm.clip_low", ""),
    "actor_rollout_ref.actor.clip_ratio_high": ("algorithm.clip_high", ""),
    "actor_rollout_ref.actor.clip_ratio_c": ("algorithm.dual_clip", ""),
    "actor_rollout_ref.actor.use_kl_loss": ("algorithm.kl_in", "use_kl_loss=true is algorithm.kl_in=loss"),
    "actor_rollout_ref.actor.kl_loss_coef": ("algorithm.kl_coef", ""),
    "actor_rollout_ref.actor.kl_loss_type": ("algorithm.kl_estimator", "low_var_kl is k3"),
    "actor_rollout_ref.actor.entropy_coeff": ("algorithm.entropy_coef", ""),
    "actor_rollout_ref.actor.loss_agg_mode": ("algorithm.aggregation", ""),
    "actor_rollout_ref.actor.grad_clip": ("optim.max_grad_norm", ""),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("model.gradient_checkpointing", ""),
    "critic.optim.lr": ("optim.critic_lr", ""),
    "critic.model.path": ("model.critic_name_or_path", ""),
    "data.train_files": ("data.path", ""),
    "data.val_files": ("data.eval_path", ""),
    "data.prompt_key": ("data.prompt_column", ""),
    "data.train_batch_size": ("rollout.prompts_per_step", ""),
    "data.max_prompt_length": ("rollout.max_prompt_length", ""),
    "data.max_response_length": ("rollout.max_new_tokens", ""),
    "algorithm.adv_estimator": ("algorithm.advantage", "or a whole preset with algorithm.name"),
    "algorithm.use_kl_in_reward": ("algorithm.kl_in", "use_kl_in_reward=true is algorithm.kl_in=reward"),
    "algorithm.kl_ctrl.kl_coef": ("algorithm.kl_coef", ""),
    "algorithm.kl_ctrl.target_kl": ("algorithm.kl_target", ""),
    "algorithm.kl_penalty": ("algorithm.kl_estimator", ""),
    "trainer.total_training_steps": ("train.steps", ""),
    "trainer.total_epochs": ("train.steps", "lmrl counts steps"),
    "trainer.save_freq": ("train.save_every", ""),
    "trainer.test_freq": ("train.eval_every", ""),
    "trainer.default_local_dir": ("train.output_dir", ""),
    "trainer.n_gpus_per_node": ("train.parallel", "lmrl train --nproc N (or torchrun) sets the processes"),
    "trainer.logger": ("log.wandb", "or log.tensorboard; metrics.jsonl is always written"),
}


def _paths(prefix: str, value: Any) -> list[str]:
    """Every dotted path under prefix: a mapping's leaves, or prefix itself."""
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in _paths(f"{prefix}.{k}", v)]
    return [prefix]


def explain_foreign_name(path: str, value: Any = None) -> str | None:
    """The one line for an unknown config key that another framework's config uses, else None.

    Args:
        path: the unknown key's dotted path in the config (`learning_rate`, `optim.learning_rate`,
            `actor_rollout_ref`).
        value: its value; a mapping is searched for verl's dotted paths under `path`.
    """
    for full in _paths(path, value):
        if full in VERL_PATHS:
            field, note = VERL_PATHS[full]
            return f"{full} is verl's name; lmrl calls it {field}" + (f" ({note})" if note else "")
    key = path.rpartition(".")[2]
    if key in FLAT_NAMES:
        framework, field, note = FLAT_NAMES[key]
        where = "" if key == path else f"{path}: "
        return f"{where}{key} is {framework}'s name; lmrl calls it {field}" + (f" ({note})" if note else "")
    return None
