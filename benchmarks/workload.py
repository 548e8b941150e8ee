"""The benchmark's workload, built offline and deterministically from one seed.

Every runner (`ppo_lab_run.py`, `trl_ppo.py`, `floor.py`) builds its models and prompts here,
so all of them see the same tokenizer, the same initial weights and the same prompts:

* a word-level tokenizer over `vocab` ids: the specials [PAD] [UNK] [BOS] [EOS], then synthetic
  lowercase pseudo-words (a word is one token; the decoder joins tokens with spaces);
* a random-init GPT-2 (2 layers, 4 heads, d = 128, 128 positions) as the policy, the same
  weights again as the reference, and two `GPT2ForSequenceClassification(num_labels=1)` with
  their own seeds as the value model and the reward model;
* 256 prompts of 8 to 16 words.

The generators (words, prompts) use `random.Random` streams of their own, and each model is
built right after `torch.manual_seed`, so nothing depends on what ran before in the process.
Nothing here reads from or writes to a model hub.
"""

from __future__ import annotations

import argparse
import os

for _name, _value in (
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("HF_HUB_DISABLE_TELEMETRY", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
    ("TRL_EXPERIMENTAL_SILENCE", "1"),
):
    os.environ.setdefault(_name, _value)

import json
import platform
import random
import resource
import statistics
import string
import sys

import torch

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")

# The workload, in one place (every runner's flags default to these).
DEFAULTS = dict(
    vocab=1024,
    n_layer=2,
    n_head=4,
    n_embd=128,
    n_positions=128,
    n_prompts=256,
    prompt_min=8,
    prompt_max=16,
    batch=32,
    response_length=32,
    ppo_epochs=4,
    mini_batches=4,
    lr=1e-5,
    temperature=0.7,
    kl_coef=0.05,
    updates=16,
    seed=0,
    threads=1,
)

# Seed offsets of the four models: the reference shares the policy's seed (identical weights).
POLICY_SEED, VALUE_SEED, REWARD_SEED = 0, 1, 2


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument("--vocab", type=int, default=d["vocab"], help="tokenizer size (4 specials + words)")
    parser.add_argument("--n-layer", type=int, default=d["n_layer"])
    parser.add_argument("--n-head", type=int, default=d["n_head"])
    parser.add_argument("--n-embd", type=int, default=d["n_embd"])
    parser.add_argument("--n-positions", type=int, default=d["n_positions"])
    parser.add_argument("--n-prompts", type=int, default=d["n_prompts"])
    parser.add_argument("--prompt-min", type=int, default=d["prompt_min"], help="shortest prompt, in tokens")
    parser.add_argument("--prompt-max", type=int, default=d["prompt_max"], help="longest prompt, in tokens")
    parser.add_argument("--batch", type=int, default=d["batch"], help="responses sampled per PPO update")
    parser.add_argument("--response-length", type=int, default=d["response_length"], help="new tokens per response (fixed: no stop token)")
    parser.add_argument("--ppo-epochs", type=int, default=d["ppo_epochs"])
    parser.add_argument("--mini-batches", type=int, default=d["mini_batches"], help="minibatches per epoch (one optimizer step each)")
    parser.add_argument("--lr", type=float, default=d["lr"])
    parser.add_argument("--temperature", type=float, default=d["temperature"])
    parser.add_argument("--kl-coef", type=float, default=d["kl_coef"])
    parser.add_argument("--updates", type=int, default=d["updates"], help="PPO updates (rollout + optimisation) to time")
    parser.add_argument("--seed", type=int, default=d["seed"])
    parser.add_argument("--threads", type=int, default=d["threads"], help="torch.set_num_threads (0 = leave torch's default)")


def setup_process(args) -> None:
    """Threads and the transformers log level: call first in every runner."""
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


# --- tokenizer and prompts ------------------------------------------------------------------
def pseudo_words(n: int, seed: int) -> list[str]:
    """n distinct lowercase words of 2 to 7 letters, the same for the same (n, seed)."""
    rng = random.Random(seed)
    out: list[str] = []
    taken: set[str] = set()
    while len(out) < n:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


def make_tokenizer(vocab: int, seed: int):
    """A left-padding word-level fast tokenizer with exactly `vocab` ids; also returns the words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = pseudo_words(vocab - len(SPECIAL_TOKENS), seed)
    ids = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    core = Tokenizer(models.WordLevel(vocab=ids, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # a space between word tokens
    pad, unk, bos, eos = SPECIAL_TOKENS
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=pad, unk_token=unk, bos_token=bos, eos_token=eos, padding_side="left"
    )
    if len(tok) != vocab:
        raise RuntimeError(f"tokenizer has {len(tok)} ids, expected {vocab}")
    return tok, words


def make_prompt_texts(words: list[str], n: int, min_len: int, max_len: int, seed: int) -> list[str]:
    """n prompts of min_len..max_len words each."""
    rng = random.Random(seed + 1)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


def make_prompt_ids(tok, texts: list[str]) -> list[list[int]]:
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    for text, row in zip(texts, ids):
        if len(row) != len(text.split()):
            raise RuntimeError("the word-level tokenizer must map each word to one id")
    return ids


# --- models ---------------------------------------------------------------------------------
def gpt2_config(tok, args, num_labels: int | None = None):
    from transformers import GPT2Config

    extra = {} if num_labels is None else {"num_labels": num_labels}
    return GPT2Config(
        vocab_size=len(tok),
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )


def make_policy(tok, args):
    """Random-init GPT2LMHeadModel (seed + POLICY_SEED); call twice for policy and reference."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(args.seed + POLICY_SEED)
    model = GPT2LMHeadModel(gpt2_config(tok, args))
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
    return model


def make_scalar_model(tok, args, seed_offset: int):
    """Random-init GPT2ForSequenceClassification(num_labels=1): the value or the reward model."""
    from transformers import GPT2ForSequenceClassification

    torch.manual_seed(args.seed + seed_offset)
    return GPT2ForSequenceClassification(gpt2_config(tok, args, num_labels=1))


def make_value_model(tok, args):
    return make_scalar_model(tok, args, VALUE_SEED)


def make_reward_model(tok, args):
    return make_scalar_model(tok, args, REWARD_SEED)


def no_dropout(model):
    """Every Dropout to p = 0, the module left in its mode (what TRL does to its models)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# --- reporting ------------------------------------------------------------------------------
def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def median_after_first(xs: list[float]) -> float:
    """Median of the steady state: every value but the first (warm-up), unless there is only one."""
    return statistics.median(xs[1:] or xs)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "accelerate": version("accelerate"),
        "trl": version("trl"),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "nproc": os.cpu_count(),
    }


def timing_fields(update_s: list[float], args) -> dict:
    """The fields every runner reports about its per-update wall times."""
    tokens = args.batch * args.response_length
    steady = median_after_first(update_s)
    return {
        "updates": len(update_s),
        "sec_per_update": round(steady, 4),
        "sec_per_update_min": round(min(update_s[1:] or update_s), 4),
        "sec_per_update_max": round(max(update_s[1:] or update_s), 4),
        "first_update_s": round(update_s[0], 4),
        "update_s": [round(x, 4) for x in update_s],
        "tokens_per_update": tokens,
        "tokens_per_s": round(tokens / steady, 1),
    }


def emit(result: dict) -> None:
    """The runner's one line of JSON on stdout (everything else goes to stderr)."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
