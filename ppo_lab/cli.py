"""The `ppo-lab` command line: `ppo-lab train [config.yaml] [--field value ...]`.

Every field of `PPOConfig` is a flag (`ppo-lab train --help` lists them with their help text);
flags override the YAML file, which overrides the defaults. With no arguments, `ppo-lab train`
trains the built-in tiny model on the sentiment task, offline, and prints sample responses
before and after.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import __all__ as exported
from . import __version__


def _print_samples(title: str, samples: list[dict]) -> None:
    print(f"\n{title} (mean score {sum(s['score'] for s in samples) / len(samples):+.3f})")
    for s in samples:
        print(f"  {s['score']:+.2f}  {s['prompt']} | {s['response']}")


def train(args: argparse.Namespace) -> int:
    from .config import PPOConfig

    try:
        config = PPOConfig.from_args(args.config, args)
    except ValueError as err:
        print(f"ppo-lab: error: {err}", file=sys.stderr)
        return 2
    import torch

    from .trainer import PPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        trainer = PPOTrainer(config)
    except ValueError as err:
        print(f"ppo-lab: error: {err}", file=sys.stderr)
        return 2
    before = trainer.evaluate(8)
    _print_samples("Before training", before)
    history = trainer.train()
    after = trainer.evaluate(8)
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
    parser = argparse.ArgumentParser(prog="ppo-lab", description="PPO Lab: Proximal Policy Optimization for language models.")
    parser.add_argument("--version", action="version", version=f"ppo-lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    tr = sub.add_parser("train", help="train a policy with PPO (default: the offline tiny model on the sentiment task)")
    tr.add_argument("config", nargs="?", help="a YAML file of PPOConfig fields")
    tr.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    from .config import PPOConfig

    PPOConfig.add_arguments(tr)
    sub.add_parser("api", help="list the functions and classes ppo_lab exports")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
