"""The offline default model: a tiny GPT-2 and its word-level tokenizer, shipped with the package.

Chapter 1 (RL for language models) rolls it out token by token; every chapter that needs a real
language model uses it. No machine that builds the book can download weights, and a chapter
must train in about a minute on two CPU cores, so `ppo_lab` carries its own model, pretrained on
the text of its built-in tasks (`ppo_lab.tasks`): review-like sentences and digit-by-digit
additions. The weights (safetensors) and the tokenizer are package data under
`ppo_lab/data/tiny/`, the same bytes on every machine, and load with
`AutoModelForCausalLM.from_pretrained` like a model from the hub, so the code path the book
exercises is the one real models take.

Why ship the bytes instead of building them on first use: float rounding differs between CPUs
(the order of reductions in a matmul depends on the vector width), so the same ~1000 SGD steps
give different weights on different machines, and every number downstream changes. Only files
shipped byte for byte are the same everywhere.

The code that trains it stays here (`pretrain`), and `python -m ppo_lab.tiny build` rebuilds
the shipped folder (about a minute on one CPU thread). A rebuild on another machine gives
other bytes of the same quality; `tests/test_tiny.py` checks that a rebuild reaches the shipped
model's held-out loss, and that the shipped tokenizer still matches the tasks' vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TINY_MODEL = "builtin:tiny"  # the name the config uses for this model
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SHIPPED = Path(__file__).resolve().parent / "data" / "tiny"  # package data: weights and tokenizer
HELD_OUT_SEED = 987654  # the held-out text's seed; pretraining uses seeds 0 and 1


@dataclass(frozen=True)
class TinySpec:
    """Settings of the built-in model (recorded in the shipped folder's `build.json`)."""

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 96
    n_positions: int = 64
    n_sentiment: int = 40000  # pretraining sentences
    n_arithmetic: int = 10000  # pretraining additions
    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0


def build_tokenizer():
    """A word-level tokenizer over the built-in tasks' vocabulary, with pad, eos and unk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .tasks import vocabulary

    words = [PAD, EOS, UNK] + vocabulary()
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def _right_pad(ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (input_ids, attention_mask), both (B, T), padded on the right."""
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id)
    attention = torch.zeros((len(ids), width), dtype=torch.long)
    for row, x in enumerate(ids):
        input_ids[row, : len(x)] = torch.tensor(x)
        attention[row, : len(x)] = 1
    return input_ids, attention


def _pretraining_batches(tokenizer, spec: TinySpec):
    """Endless shuffled batches of (input_ids, attention_mask), each text followed by EOS."""
    from .tasks import ArithmeticTask, SentimentTask

    texts = SentimentTask().corpus(spec.n_sentiment, spec.seed)
    texts += ArithmeticTask().corpus(spec.n_arithmetic, spec.seed + 1)
    ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    rng = random.Random(spec.seed)
    while True:
        rng.shuffle(ids)
        for i in range(0, len(ids) - spec.batch_size + 1, spec.batch_size):
            yield _right_pad(ids[i : i + spec.batch_size], tokenizer.pad_token_id)


def pretrain(spec: TinySpec, verbose: bool = False):
    """Train the tiny GPT-2 from scratch on the tasks' text; returns (model, tokenizer)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_tokenizer()
    torch.manual_seed(spec.seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=spec.n_positions,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, spec.lr, total_steps=spec.steps, pct_start=0.1)
    batches = _pretraining_batches(tokenizer, spec)
    model.train()
    for step in range(spec.steps):
        input_ids, attention = next(batches)
        labels = input_ids.masked_fill(attention == 0, -100)  # no loss on padding
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if verbose and (step % 300 == 0 or step == spec.steps - 1):
            print(f"pretraining step {step:5d}  loss {loss.item():.3f}")
    model.eval()
    return model, tokenizer




def tiny_model_path() -> Path:
    """The folder of the shipped model and tokenizer (package data; nothing is built or fetched)."""
    if not (SHIPPED / "model.safetensors").exists() or not (SHIPPED / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"the built-in tiny model is missing from {SHIPPED} (a broken install?); "
            "reinstall ppo-lab, or rebuild it with `python -m ppo_lab.tiny build`"
        )
    return SHIPPED


def held_out_texts(n_sentiment: int = 2000, n_arithmetic: int = 500) -> list[str]:
    """Text drawn like the pretraining corpus but from another seed, to measure quality."""
    from .tasks import ArithmeticTask, SentimentTask

    return SentimentTask().corpus(n_sentiment, HELD_OUT_SEED) + ArithmeticTask().corpus(n_arithmetic, HELD_OUT_SEED + 1)


@torch.no_grad()
def held_out_loss(model, tokenizer, texts: list[str] | None = None, batch_size: int = 256) -> float:
    """Mean next-token cross-entropy (nats per token, EOS included) on `texts`."""
    texts = held_out_texts() if texts is None else texts
    total, count = 0.0, 0
    model.eval()
    for i in range(0, len(texts), batch_size):
        ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts[i : i + batch_size]]
        input_ids, attention = _right_pad(ids, tokenizer.pad_token_id)
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()  # (B, T-1, V)
        targets = input_ids[:, 1:].masked_fill(attention[:, 1:] == 0, -100)  # no loss on padding
        total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="sum").item()
        count += int((targets != -100).sum())
    return total / count


def build(folder: Path = SHIPPED, spec: TinySpec = TinySpec(), verbose: bool = True) -> Path:
    """Pretrain the tiny model and write it (weights, tokenizer, build.json) to `folder`.

    One torch thread, so that a rebuild on the same machine gives the same bytes. The folder is
    written under a temporary name and swapped in when complete, so an interrupted build never
    leaves a half-written model behind (nor destroys the previous one).
    """
    from .hf import quiet_transformers

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]), quiet_transformers():
            model, tokenizer = pretrain(spec, verbose=verbose)
            loss = held_out_loss(model, tokenizer)
    finally:
        torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    with quiet_transformers():
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    info = {"spec": asdict(spec), "held_out_loss": round(loss, 4), "torch": torch.__version__}
    (tmp / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    tmp.chmod(0o755)  # mkdtemp makes it private; an installed package must be readable by all
    for f in tmp.iterdir():
        f.chmod(0o644)
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    if verbose:
        print(f"built the tiny model in {time.perf_counter() - start:.0f} s (held-out loss {loss:.4f} nats/token): {folder}")
    return folder


def main(argv: list[str] | None = None) -> int:
    """`python -m ppo_lab.tiny build [--out FOLDER]` rebuilds the tiny model, `... loss` prints the
    shipped model's held-out loss; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m ppo_lab.tiny", description="The built-in tiny model.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    b = sub.add_parser("build", help="pretrain the tiny model and write it to a folder (default: the shipped one)")
    b.add_argument("--out", type=Path, default=SHIPPED, help=f"where to write it (default: {SHIPPED})")
    sub.add_parser("loss", help="print the shipped model's held-out loss")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = tiny_model_path()
        model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
        print(f"{held_out_loss(model, tokenizer):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
