"""The offline default model: a tiny GPT-2 and its word-level tokenizer, built from this package.

Chapter 1 (RL for language models) rolls it out token by token; every chapter that needs a real
language model uses it. No machine that builds the book can download weights, and a chapter
must train in about a minute on two CPU cores, so `ppo_lab` pretrains its own model on the
text of its built-in tasks (`ppo_lab.tasks`): review-like sentences and digit-by-digit
additions. The result is saved with `save_pretrained` to a cache folder and loaded back with
`AutoModelForCausalLM.from_pretrained`, exactly like a model from the hub, so the code path
the book exercises is the one real models take.

The build is deterministic (fixed seeds, one torch thread) and takes about a minute; it runs
once per cache key (a hash of this module, the task module and the settings), in
`$PPO_LAB_CACHE` or `~/.cache/ppo_lab`. The folder is written under a temporary name and
renamed into place, so an interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TINY_MODEL = "builtin:tiny"  # the name the config uses for this model
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


@dataclass(frozen=True)
class TinySpec:
    """Settings of the built-in model (changing any of them changes the cache key)."""

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


def cache_root() -> Path:
    return Path(os.environ.get("PPO_LAB_CACHE", Path.home() / ".cache" / "ppo_lab"))


def _cache_key(spec: TinySpec) -> str:
    from . import tasks

    h = hashlib.sha256()
    for src in (inspect.getsource(inspect.getmodule(_cache_key)), inspect.getsource(tasks)):
        h.update(src.encode())
    h.update(repr(sorted(asdict(spec).items())).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:12]


def build_tokenizer():
    """A word-level tokenizer over the built-in tasks' vocabulary, with pad, eos and unk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .tasks import vocabulary

    words = [PAD, EOS, UNK] + vocabulary()
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


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
            chunk = ids[i : i + spec.batch_size]
            width = max(len(x) for x in chunk)
            input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, x in enumerate(chunk):
                input_ids[row, : len(x)] = torch.tensor(x)
                attention[row, : len(x)] = 1
            yield input_ids, attention


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


def tiny_model_path(spec: TinySpec = TinySpec(), verbose: bool = False) -> Path:
    """The folder holding the built-in model and tokenizer, building it on first use."""
    folder = cache_root() / f"tiny-{_cache_key(spec)}"
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identical weights on every run of the same machine
    try:
        from .models import _quiet_transformers

        with torch.random.fork_rng(devices=[]), _quiet_transformers():
            model, tokenizer = pretrain(spec, verbose=verbose)
    finally:
        torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    with _quiet_transformers():
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"built the tiny model in {time.perf_counter() - start:.0f} s: {folder}")
    return folder
