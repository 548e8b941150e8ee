"""`PPOConfig`: the one typed configuration of the trainer, in groups, with its YAML files and
its command line.

Chapter 7 (The PPO trainer end to end) walks through it. The settings sit in groups, one per
part of the code that reads them (`policy`, `lora`, `critic`, `reward`, `data`, `sampling`,
`sampler`, `batch`, `optim`, `loss`, `advantage`, `kl`, `memory`, `run`), and every setting has
one dotted name used everywhere: `optim.lr` is the Python attribute `config.optim.lr`, the YAML
key `lr` under `optim:`, the flag `--optim.lr` and the name in every error message. Each field
carries its help text once (`fields._f`); the command line (`ppo-lab train --help`, grouped) and
the error messages are generated from it. A group checks its values and the relations between
them when it is constructed, `PPOConfig` the relations across groups, so a bad value fails
before any model is loaded. A name from before the groups (`learning_rate`) gets an error that
names its new place (`MOVED`).

Batch sizes, in one place. One PPO iteration samples `batch.rollout` responses (that is,
`batch.rollout / sampling.responses_per_prompt` prompts), then makes `batch.epochs` passes over
them in shuffled minibatches of `batch.minibatch` responses; each minibatch is one optimizer
step, split into micro-batches for memory. The rollout and minibatch sizes are global: under
`accelerate launch` with N processes, each process samples `batch.rollout / N` responses, the
rollout is gathered so that whitening, the KL controller and every metric see the whole batch,
and each minibatch is cut into `batch.accumulation_steps x N` micro-batches, `accumulation_steps`
on each process. A run on N processes therefore computes the same update as a run on one
process with `accumulation_steps x N` (tests/test_distributed.py checks it).
"""

from __future__ import annotations

import argparse
import difflib
import functools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .config_groups import GROUPS, Advantage, Batch, Critic, Data, Kl, Lora, Loss, Memory, Optim, Policy, Reward, Run, Sampler
from .fields import Group, settings, unknown_names
from .sampling import Sampling

# Each name from before the groups, and its place now: an old name in Python, YAML or a flag gets an
# error that names the new one, and a checkpoint written before the groups resumes (`upgrade`).
MOVED = {
    "kind": "kl.estimator",  # an older name of kl_estimator, before it moved to kl.estimator
    "policy_model": "policy.model", "tokenizer": "policy.tokenizer", "trust_remote_code": "policy.trust_remote_code",
    "lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.target_modules", "critic": "critic.design", "critic_model": "critic.model",
    "value_pooling": "critic.pooling", "critic_learning_rate": "critic.lr",
    "value_warmup_iterations": "critic.warmup_iterations", "critic_lam": "critic.lam", "value_clip": "critic.clip",
    "vf_coef": "critic.loss_coef", "reward": "reward.source", "reward_label_index": "reward.label_index",
    "score_clip": "reward.clip", "score_norm": "reward.normalize", "missing_eos_penalty": "reward.truncated_penalty",
    "missing_eos_score": "reward.truncated_score", "reference_score_norm": "reward.reference_norm",
    "reference_score_samples": "reward.reference_samples", "overlong_buffer": "reward.overlong_buffer",
    "overlong_penalty_factor": "reward.overlong_penalty", "task": "data.task", "prompts_file": "data.prompts_file",
    "eval_prompts_file": "data.eval_prompts_file", "prompt_field": "data.prompt_field",
    "max_new_tokens": "sampling.max_new_tokens", "temperature": "sampling.temperature", "top_k": "sampling.top_k",
    "top_p": "sampling.top_p", "stop_token": "sampling.stop_token", "stop_after": "sampling.stop_after",
    "ignore_eos": "sampling.ignore_eos", "responses_per_prompt": "sampling.responses_per_prompt",
    "dynamic_sampling": "sampling.dynamic", "dynamic_sampling_max_rounds": "sampling.dynamic_max_rounds",
    "old_logprobs": "sampler.old_logprobs_from", "rollout_correction": "sampler.correction",
    "rollout_correction_level": "sampler.correction_level", "rollout_correction_low": "sampler.correction_low",
    "rollout_correction_high": "sampler.correction_high", "sampler_noise": "sampler.noise",
    "sampler_precision": "sampler.precision", "rollout_batch_size": "batch.rollout",
    "minibatch_size": "batch.minibatch", "forward_batch_size": "batch.forward",
    "gradient_accumulation_steps": "batch.accumulation_steps", "ppo_epochs": "batch.epochs",
    "learning_rate": "optim.lr", "lr_schedule": "optim.schedule", "warmup_steps": "optim.warmup_steps",
    "weight_decay": "optim.weight_decay", "adam_eps": "optim.adam_eps", "max_grad_norm": "optim.max_grad_norm",
    "grad_clip_scope": "optim.clip_scope", "target_kl": "optim.early_stop_kl", "policy_loss": "loss.policy",
    "clip_eps": "loss.clip_eps", "clip_eps_high": "loss.clip_eps_high", "dual_clip": "loss.dual_clip",
    "penalty_beta": "loss.penalty_beta", "penalty_kl_target": "loss.penalty_target",
    "entropy_coef": "loss.entropy_coef", "loss_agg": "loss.aggregation", "advantage_estimator": "advantage.estimator",
    "gamma": "advantage.gamma", "lam": "advantage.lam", "whiten_advantages": "advantage.whiten",
    "whiten_rewards": "advantage.whiten_rewards", "overlong_filter": "advantage.drop_truncated", "kl_coef": "kl.coef",
    "kl_estimator": "kl.estimator", "kl_in": "kl.placement", "kl_control": "kl.control", "kl_target": "kl.target",
    "kl_horizon": "kl.horizon", "precision": "memory.precision",
    "gradient_checkpointing": "memory.gradient_checkpointing", "logprob_chunk_size": "memory.logprob_chunk",
    "torch_compile": "memory.compile", "seed": "run.seed", "total_iterations": "run.iterations",
    "output_dir": "run.output_dir", "overwrite_output_dir": "run.overwrite", "log_interval": "run.log_interval",
    "eval_interval": "run.eval_interval", "eval_prompts": "run.eval_count", "save_interval": "run.save_interval",
    "keep_checkpoints": "run.keep_checkpoints", "resume_from": "run.resume_from",
    "max_bad_updates": "run.max_bad_updates", "report_to": "run.report_to", "progress_bar": "run.progress_bar",
    "reproduce": "run.reproduce",
}


def _group(cls):
    return field(default_factory=cls, metadata={"help": (cls.__doc__ or "").strip().split("\n\n")[0]})


@dataclass
class PPOConfig:
    """Every setting of a run, in groups. `PPOConfig(optim={"lr": 1e-4})`,
    `PPOConfig(optim=Optim(lr=1e-4))` and `PPOConfig(**{"optim.lr": 1e-4})` are one config."""

    policy: Policy = _group(Policy)
    lora: Lora = _group(Lora)
    critic: Critic = _group(Critic)
    reward: Reward = _group(Reward)
    data: Data = _group(Data)
    sampling: Sampling = _group(Sampling)
    sampler: Sampler = _group(Sampler)
    batch: Batch = _group(Batch)
    optim: Optim = _group(Optim)
    loss: Loss = _group(Loss)
    advantage: Advantage = _group(Advantage)
    kl: Kl = _group(Kl)
    memory: Memory = _group(Memory)
    run: Run = _group(Run)

    def __post_init__(self):
        for key, cls in GROUPS.items():
            value = getattr(self, key)
            if isinstance(value, dict):
                unknown = unknown_names(cls, value, moved=MOVED)
                if unknown:  # an unknown keyword, as Python would say (from_dict makes it a ValueError)
                    raise TypeError(unknown)
                value = cls(**value)
            elif not isinstance(value, cls):
                raise TypeError(f"PPOConfig.{key} must be a {cls.__name__} or a dict of its fields, got {type(value).__name__}")
            setattr(self, key, value)
        self.check()

    def validate(self) -> None:
        """Check every group again (after a field was changed in place), then the relations across groups."""
        for key in GROUPS:
            getattr(self, key).validate()
        self.check()

    def check(self) -> None:
        """The relations across groups; ValueError names the fields by their dotted names."""
        s, adv = self.sampling, self.advantage
        if adv.estimator == "gae" and self.critic.design == "none":
            raise ValueError("critic.design = 'none' cannot be used with advantage.estimator = 'gae', which needs values; use 'separate' or 'shared', or a critic-free estimator (reinforce, rloo, grpo, dr_grpo, reinforce_pp, reinforce_pp_baseline)")
        if s.ignore_eos and (adv.drop_truncated or self.reward.overlong_buffer):
            raise ValueError("sampling.ignore_eos makes every response exactly max_new_tokens long, so advantage.drop_truncated would remove every advantage and reward.overlong_buffer would penalise every response alike; switch them off")
        if s.ignore_eos and (self.reward.truncated_penalty is not None or self.reward.truncated_score is not None):
            raise ValueError("sampling.ignore_eos never lets a response stop, so reward.truncated_penalty or reward.truncated_score would hit every response; set them to None")
        if adv.estimator in GROUP_ESTIMATORS and s.responses_per_prompt < 2:
            raise ValueError(f"advantage.estimator = {adv.estimator!r} compares responses to the same prompt: set sampling.responses_per_prompt >= 2 (got {s.responses_per_prompt})")
        not_sharded = {"sampler.noise": self.sampler.noise > 0, "memory.compile": self.memory.compile,
                       "sampling.decode = 'cuda_graph'": s.decode == "cuda_graph"}
        if self.memory.sharding == "fsdp2" and any(not_sharded.values()):
            names = ", ".join(k for k, on in not_sharded.items() if on)
            raise ValueError(f"memory.sharding = 'fsdp2' does not run with {names} yet (the sampler's copy of the weights, "
                             "compilation and a captured decode step are not built for sharded models); "
                             "switch them off, or use memory.sharding = 'none'")
        if self.memory.frozen_weights == "bf16" and self.memory.precision != "bf16":
            raise ValueError(f"memory.frozen_weights = 'bf16' needs memory.precision = 'bf16' (got {self.memory.precision!r}): under other precisions the frozen "
                             "models would compute with rounded weights while the policy does not, and the first KL would not be 0; use 'auto' or 'fp32'")
        if self.reward.overlong_buffer > s.max_new_tokens:
            raise ValueError(f"reward.overlong_buffer = {self.reward.overlong_buffer} is longer than the budget sampling.max_new_tokens = {s.max_new_tokens}")
        from .disagreements import parse_reproduce

        if "gae-over-padding" in parse_reproduce(self.run.reproduce) and adv.estimator != "gae":
            raise ValueError(f"run.reproduce = 'gae-over-padding' changes the GAE recursion, but advantage.estimator = {adv.estimator!r}; use 'gae'")
        self.check_divisibility(processes=1)

    def check_divisibility(self, processes: int) -> None:
        """Batch sizes must split evenly into minibatches, micro-batches and processes."""
        b = self.batch
        pairs = [
            ("batch.rollout", b.rollout, "sampling.responses_per_prompt", self.sampling.responses_per_prompt),
            ("batch.rollout", b.rollout, "batch.minibatch", b.minibatch),
            ("batch.minibatch", b.minibatch, "batch.accumulation_steps", b.accumulation_steps),
        ]
        if processes > 1:
            pairs.append(("batch.rollout", b.rollout, "the number of processes", processes))
            pairs.append(("batch.minibatch", b.minibatch, "batch.accumulation_steps x processes", b.accumulation_steps * processes))
        for a, av, what, bv in pairs:
            if av % bv:
                raise ValueError(f"PPOConfig: {a} = {av} is not divisible by {what} = {bv}")

    # ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """{group: {field: value}}, the form of a YAML file."""
        return {key: getattr(self, key).to_dict() for key in GROUPS}

    def flat(self) -> dict:
        """{"group.field": value}, the form of the flags."""
        return {f"{key}.{name}": value for key, values in self.to_dict().items() for name, value in values.items()}

    def replace(self, *settings: dict, **groups) -> PPOConfig:
        """A copy with `settings` (dicts of dotted names or groups, applied in order) changed."""
        return PPOConfig.from_dict(self.flat(), *settings, groups)

    @classmethod
    def from_dict(cls, *data: dict) -> PPOConfig:
        """A config from dicts of groups (`{"optim": {"lr": 1e-4}}`) or dotted names
        (`{"optim.lr": 1e-4}`), later ones winning; an unknown or old name is a ValueError."""
        groups = nest(*data)
        try:
            return cls(**groups)
        except TypeError as err:  # an unknown field inside a group: bad input, like any other
            raise ValueError(str(err)) from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> PPOConfig:
        """Read a YAML mapping of groups (or dotted names) to values; dotted overrides win.

        `path` may also name a preset shipped with the package (see `presets()`).
        """
        path = Path(path)
        if not path.exists() and (PRESETS / f"{path}.yaml").exists():
            path = PRESETS / f"{path}.yaml"
        if not path.exists():
            raise ValueError(f"config file {str(path)!r} does not exist (presets: {', '.join(presets())})")
        if path.is_dir():
            raise ValueError(f"config file {str(path)!r} is a folder; give a YAML file of PPOConfig groups")
        if path.stat().st_size > 1 << 20:
            raise ValueError(f"config file {str(path)!r} has {path.stat().st_size / 2**20:.0f} MB: not a YAML file of PPOConfig groups")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as err:
            raise ValueError(f"config file {str(path)!r} cannot be read: {err.strerror or err}") from None
        except UnicodeDecodeError:
            raise ValueError(f"config file {str(path)!r} is not a text file; give a YAML file of PPOConfig groups") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"config file {str(path)!r} is not valid YAML{where}: {problem}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of group: fields, got {type(data).__name__}")
        try:
            return cls.from_dict(data, overrides)
        except (TypeError, ValueError) as err:
            raise type(err)(f"config file {str(path)!r}: {err}") from None

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One --group.field flag per setting, listed by group with its help text; every default
        is None (= not given)."""
        import typing

        from .fields import _base_type

        for key, group_cls in GROUPS.items():
            section = parser.add_argument_group(key, (group_cls.__doc__ or "").strip().split("\n\n")[0])
            hints = typing.get_type_hints(group_cls)
            for f in settings(group_cls):
                kind = _base_type(hints[f.name])
                kwargs = {"default": None, "help": f.metadata["help"] + f" (default: {f.default!r})", "metavar": kind.__name__.upper()}
                if "choices" in f.metadata:
                    kwargs["choices"] = f.metadata["choices"]
                    kwargs.pop("metavar")
                spellings = dict.fromkeys([f"--{key}.{f.name}", f"--{key}.{f.name.replace('_', '-')}"])  # one flag when the name has no '_'
                section.add_argument(*spellings, dest=f"{key}.{f.name}", type=str, **kwargs)

    @classmethod
    def from_args(cls, config_path: str | None, args: argparse.Namespace) -> PPOConfig:
        names = [f"{key}.{f.name}" for key, group_cls in GROUPS.items() for f in settings(group_cls)]
        overrides = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        if config_path:
            return cls.from_yaml(config_path, **overrides)
        return cls.from_dict(overrides)


def nest(*data: dict) -> dict:
    """Merge dicts of groups and of dotted names into {group: {field: value}}, later ones winning.

    A group given as an object joins as its settings. Names from before the groups, and names that
    are neither a group nor a dotted setting, raise a ValueError that says where they went or
    what was probably meant.
    """
    out: dict[str, dict] = {}
    for d in data:
        for name, value in d.items():
            key, _, rest = name.partition(".")
            if key in GROUPS and not rest and isinstance(value, (dict, Group)):
                pass  # `critic` and `reward` were settings before they were groups
            elif name in MOVED:
                raise ValueError(f"{name} is now {MOVED[name]}" + _others(d, name))
            if key not in GROUPS:
                raise ValueError(_unknown(name))
            if rest:
                out.setdefault(key, {})[rest] = value
            elif isinstance(value, Group):  # its settings (a Sampling's stop_ids are the build's, not the config's)
                out.setdefault(key, {}).update({f.name: getattr(value, f.name) for f in settings(value)})
            elif isinstance(value, dict):
                out.setdefault(key, {}).update(value)
            else:
                raise ValueError(f"PPOConfig.{key} is a group: give a dict of its fields or a {GROUPS[key].__name__}, or set one field as {key}.FIELD")
    return out


def _others(d: dict, first: str) -> str:
    more = [n for n in d if n in MOVED and n != first]
    return "; " + "; ".join(f"{n} is now {MOVED[n]}" for n in more) if more else ""


def _unknown(name: str) -> str:
    """"unknown setting 'lr' (did you mean 'optim.lr'?)": the one dotted name ending in it, else
    the nearest spelling."""
    dotted = [f"{key}.{f.name}" for key, cls in GROUPS.items() for f in settings(cls)]
    near = [d for d in dotted if d.endswith("." + name)] or difflib.get_close_matches(name, dotted + list(GROUPS), 1)
    guess = f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""
    return f"unknown PPOConfig setting {name!r}{guess}; the groups are {', '.join(GROUPS)}"


def upgrade(saved: dict) -> dict:
    """A config dict written before the groups (flat names), in today's nested form; names it
    no longer knows are dropped. A nested dict is returned as it is."""
    if all(isinstance(value, dict) for value in saved.values()):
        return saved
    out: dict[str, dict] = {}
    for name, value in saved.items():
        if name in MOVED:
            key, field_name = MOVED[name].split(".")
            out.setdefault(key, {})[field_name] = value
    return out


def free_on_resume() -> set[str]:
    """The dotted settings a resumed run may change (the rest must match the checkpoint's config)."""
    return {f"{key}.{f.name}" for key, cls in GROUPS.items() for f in settings(cls) if f.metadata["resume"] == "free"}


def _init_with_names(init):
    """Wrap the dataclass's __init__ so that dotted names work (`PPOConfig(**{"optim.lr": 1e-4})`)
    and an old or misspelt name is a TypeError that says where it went."""

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        try:
            groups = nest(kwargs)
        except ValueError as err:
            raise TypeError(str(err)) from None
        init(self, *args, **groups)

    return checked


PPOConfig.__init__ = _init_with_names(PPOConfig.__init__)

PRESETS = Path(__file__).parent / "presets"
# the estimators whose baseline is the other responses to the same prompt (responses_per_prompt >= 2)
GROUP_ESTIMATORS = ("rloo", "grpo", "dr_grpo", "reinforce_pp_baseline")


# chapter 10's algorithms, one preset each, all on the tiny model and the arithmetic task (offline)
ALGORITHM_PRESETS = ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo", "cispo")


def presets() -> list[str]:
    """Names of the preset configs shipped with the package (`ppo-lab train NAME`)."""
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))
