"""The `ppo-lab` command line: `ppo-lab train [config.yaml] [--group.field value ...]`.

Every setting of `PPOConfig` is a flag named by its group (`--optim.lr 1e-4`; `ppo-lab train
--help` lists them group by group with their help text); flags override the YAML file, which
overrides the defaults. With no arguments, `ppo-lab train`
trains the built-in tiny model on the sentiment task, offline, and prints sample responses
before and after.

Expected errors (a bad config or YAML file, a model that cannot be loaded, a reward that returns
the wrong shape, an output folder that holds another run or cannot be written, a full disk, a
run stopped for nan) print one line, `ppo-lab: error: ...`, and exit with a non-zero code: 2
for bad input, 1 for a run that failed. `--traceback` (or `PPO_LAB_TRACEBACK=1`) shows the
full traceback instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from . import __all__ as exported
from . import __version__


def _print_samples(title: str, samples: list[dict]) -> None:
    print(f"\n{title} (mean score {sum(s['score'] for s in samples) / len(samples):+.3f})")
    for s in samples:
        print(f"  {s['score']:+.2f}  {s['prompt']} | {s['response']}")


def _one_line_warnings() -> None:
    """The run's own warnings as one line each, `ppo-lab: warning: ...`, like its errors (Python's
    format adds the file, line and source of the warning call, which tell a user nothing); other
    libraries' warnings keep that format, which names where they come from."""
    import warnings

    plain, here = warnings.formatwarning, os.path.dirname(os.path.abspath(__file__))

    def one_line(message, category, filename, lineno, line=None):
        if os.path.abspath(filename).startswith(here + os.sep):
            return f"ppo-lab: warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    warnings.formatwarning = one_line


def train(args: argparse.Namespace) -> int:
    """`ppo-lab train`: train with the config the arguments give, printing samples before and
    after. Returns the exit status: 0, 2 for bad input (the config, a model, the output folder),
    1 for a run that failed; the error is one line unless `--traceback` or `PPO_LAB_TRACEBACK`."""
    from .trainer import NonFiniteError

    if not _traceback_wanted(args):
        _one_line_warnings()
    try:
        return _train(args)
    except ValueError as err:  # bad input: config, YAML, models, reward, output folder, checkpoints
        return _error(err, 2, args)
    except (NonFiniteError, OSError) as err:  # the run failed: nan, a full disk, a permission
        return _error(err, 1, args)


def _traceback_wanted(args: argparse.Namespace) -> bool:
    return args.traceback or os.environ.get("PPO_LAB_TRACEBACK", "0").lower() not in ("0", "", "false", "no", "off")


def _error(err: BaseException, code: int, args: argparse.Namespace) -> int:
    if _traceback_wanted(args):
        raise err
    message = re.sub(r"^\[Errno \d+\] ", "", str(err).strip()) or type(err).__name__
    print(f"ppo-lab: error: {message}", file=sys.stderr)
    return code


def _train(args: argparse.Namespace) -> int:
    from .config import PPOConfig

    config = PPOConfig.from_args(args.config, args)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads = {args.threads} must be an integer >= 1")
    import torch

    from .trainer import PPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    trainer = PPOTrainer(config)
    shown = min(8, len(trainer.eval_prompts))  # a task may have fewer eval prompts
    before = trainer.evaluate(shown)
    _print_samples("Before training", before)
    history = trainer.train()
    after = trainer.evaluate(shown)
    _print_samples("After training", after)
    first, last = history[0], history[-1]
    tail = history[-max(1, len(history) // 10) :]
    print(
        f"\nreward/score_mean {first['reward/score_mean']:+.3f} -> {sum(m['reward/score_mean'] for m in tail) / len(tail):+.3f} "
        f"(mean of the last {len(tail)} iterations), objective/kl {last['objective/kl']:.2f}, "
        f"{len(history)} iterations in {time.perf_counter() - start:.0f} s"
    )
    print(f"metrics: {trainer.output_dir / 'metrics.jsonl'}   policy: {trainer.output_dir / 'policy'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `ppo-lab` command (`train`, `api`) on `argv` (default: the command line's); returns
    the exit status."""
    # allow_abbrev=False: a prefix such as --optim.max would otherwise be "ambiguous" between the
    # two spellings of one option (--optim.max_grad_norm, --optim.max-grad-norm); unknown options
    # get a suggestion.
    parser = argparse.ArgumentParser(prog="ppo-lab", description="PPO Lab: Proximal Policy Optimization for language models.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"ppo-lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    tr = sub.add_parser(
        "train", help="train a policy with PPO (default: the offline tiny model on the sentiment task)", allow_abbrev=False,
        usage="ppo-lab train [config.yaml | preset] [--group.field value ...]  (--help lists the settings by group)",
    )
    tr.add_argument("config", nargs="?", help="a YAML file of PPOConfig groups (or a preset's name)")
    tr.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    tr.add_argument("--traceback", action="store_true", help="on an error, show the full traceback instead of one line (also: PPO_LAB_TRACEBACK=1)")
    from .config import PPOConfig

    PPOConfig.add_arguments(tr)
    sub.add_parser("api", help="list the functions and classes ppo_lab exports")
    args, unknown = parser.parse_known_args(_join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    if unknown:
        (tr if args.command == "train" else parser).error(_unknown_message(unknown, tr if args.command == "train" else parser))
    if args.command == "train":
        return train(args)
    if args.command == "api":
        import ppo_lab

        for name in sorted(n for n in exported if not n.startswith("_")):
            doc = (getattr(ppo_lab, name).__doc__ or "").strip().splitlines()
            summary = doc[0] if doc and callable(getattr(ppo_lab, name)) else ""
            print(f"{name:32s} {summary}")
        return 0
    parser.print_help()
    return 0


# Short names users type for a setting, pointed to it (difflib alone would send --lr to --lora.r).
ALIASES = {"lr": "optim.lr", "epochs": "batch.epochs", "batch_size": "batch.rollout", "beta": "kl.coef", "kl": "kl.coef", "output": "run.output_dir", "resume": "run.resume_from"}


def _unknown_message(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """"unknown option --learn; did you mean --optim.lr?" for the first unknown token, and
    "--learning_rate is now --optim.lr" for a flag from before the config's groups."""
    import difflib

    from .config import MOVED

    token = unknown[0]
    if not token.startswith("-"):
        return f"unexpected argument {token!r} (options are written --name value)"
    name = token.lstrip("-").split("=", 1)[0].replace("-", "_")
    if name in MOVED:
        return f"--{name} is now --{MOVED[name]}"
    options = sorted({s.lstrip("-").replace("-", "_") for a in parser._actions for s in a.option_strings if s.startswith("--")})
    guess = ALIASES.get(name) if ALIASES.get(name) in options else None
    ends = [o for o in options if o.endswith("." + name)]
    prefixed = [o for o in options if o.startswith(name)]
    guess = guess or (ends[0] if len(ends) == 1 else None) or (prefixed[0] if len(prefixed) == 1 else None) or next(iter(difflib.get_close_matches(name, options, n=1)), None)
    return f"unknown option {token.split('=', 1)[0]}" + (f"; did you mean --{guess}?" if guess else "") + " (ppo-lab train --help lists them)"


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--optim.lr -1e-4` -> `--optim.lr=-1e-4`.

    argparse takes a token starting with "-" for an option unless it looks like a plain negative
    number ("-1e-4" does not), and then reports a missing value; joined, the value reaches the
    config, which names the field and its range.
    """
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and token.startswith("-") and _is_number(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
