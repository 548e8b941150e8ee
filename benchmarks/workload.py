"""The benchmark's workload, built offline and deterministically from one seed.

Every runner (`ppo_lab_run.py`, `trl_ppo.py`, `floor.py`) builds its models and prompts here,
so all of them see the same tokenizer, the same initial weights and the same prompts:

* a word-level tokenizer over `vocab` ids: the specials [PAD] [UNK] [BOS] [EOS], then synthetic
  lowercase pseudo-words (a word is one token; the decoder joins tokens with spaces);
* a random-init GPT-2 (2 layers, 4 heads, d = 128, 128 positions) as the policy, the same
  weights again as the reference, and two `GPT2ForSequenceClassification(num_labels=1)` with
  their own seeds as the value model and the reward model (`--arch llama`: the same roles as
  `LlamaForCausalLM` / `LlamaForSequenceClassification`, untied embeddings, SwiGLU MLP of
  `--intermediate-size`, RoPE, RMSNorm);
* 256 prompts of 8 to 16 words.

The defaults are the CPU benchmark's (`run.py`); `gpu.py` passes a larger shape and
`--device cuda --precision bf16`.

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
    n_kv_head=0,
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
    arch="gpt2",
    intermediate_size=0,
    device="cpu",
    precision="fp32",
)

# Seed offsets of the four models: the reference shares the policy's seed (identical weights).
POLICY_SEED, VALUE_SEED, REWARD_SEED = 0, 1, 2


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument("--vocab", type=int, default=d["vocab"], help="tokenizer size (4 specials + words)")
    parser.add_argument("--n-layer", type=int, default=d["n_layer"])
    parser.add_argument("--n-head", type=int, default=d["n_head"])
    parser.add_argument("--n-kv-head", type=int, default=d["n_kv_head"], help="llama key/value heads (0 = --n-head)")
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
    parser.add_argument("--arch", choices=["gpt2", "llama"], default=d["arch"], help="model family of all four models")
    parser.add_argument("--intermediate-size", type=int, default=d["intermediate_size"],
                        help="llama MLP width (0 = 8/3 x d rounded up to a multiple of 256)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=d["device"],
                        help="where the trainers run (cpu hides any GPU from the process)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=d["precision"],
                        help="bf16: autocast with fp32 master weights, in both trainers")


def setup_process(args) -> None:
    """Device, threads and the transformers log level: call first in every runner."""
    device = getattr(args, "device", "cpu")
    if device == "cpu":
        # ppo_lab (through accelerate) takes a GPU whenever it sees one: hide it (before CUDA starts)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible to torch")
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


def llama_config(tok, args, num_labels: int | None = None):
    from transformers import LlamaConfig

    extra = {} if num_labels is None else {"num_labels": num_labels}
    inter = args.intermediate_size or -(-(8 * args.n_embd // 3) // 256) * 256
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.n_embd,
        intermediate_size=inter,
        num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head,
        num_key_value_heads=getattr(args, "n_kv_head", 0) or args.n_head,
        max_position_embeddings=args.n_positions,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )


def model_config(tok, args, num_labels: int | None = None):
    arch = getattr(args, "arch", "gpt2")
    return (llama_config if arch == "llama" else gpt2_config)(tok, args, num_labels)


def make_policy(tok, args):
    """Random-init causal LM (seed + POLICY_SEED); call twice for policy and reference."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(args.seed + POLICY_SEED)
    cls = LlamaForCausalLM if getattr(args, "arch", "gpt2") == "llama" else GPT2LMHeadModel
    model = cls(model_config(tok, args))
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
    return model


def make_scalar_model(tok, args, seed_offset: int):
    """Random-init *ForSequenceClassification(num_labels=1): the value or the reward model."""
    from transformers import GPT2ForSequenceClassification, LlamaForSequenceClassification

    torch.manual_seed(args.seed + seed_offset)
    cls = LlamaForSequenceClassification if getattr(args, "arch", "gpt2") == "llama" else GPT2ForSequenceClassification
    return cls(model_config(tok, args, num_labels=1))


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


def matmul_params(model) -> int:
    """Parameters that cost 2 FLOPs per token in a forward: all of them but the lookup tables
    (the input embedding, unless it is tied to the output layer, and GPT-2's position table)."""
    seen = {id(p): p for p in model.parameters()}
    lookup = [model.get_input_embeddings().weight]
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None and out.weight is lookup[0]:
        lookup = []  # tied: the table is also the output matmul
    for module in model.modules():
        if type(module).__name__ == "GPT2Model":
            lookup.append(module.wpe.weight)
    return sum(p.numel() for p in seen.values()) - sum(p.numel() for p in lookup if id(p) in seen)


def update_flops(args, n_policy: int, n_value: int, n_reward: int, prompt_mean: float) -> dict:
    """Model FLOPs of one PPO update, the same count for every trainer (see gpu.py's docstring).

    T = batch x (mean prompt length + response length) real tokens; N = matmul parameters.
    Per token a forward costs 2N, a forward + backward 6N (attention's own FLOPs, ~3% at these
    lengths, are left out):
      generation  2 N_policy T   (prefill + one decode step per new token)
      scoring     2 N_policy T (old log-probs) + 2 N_policy T (reference) + 2 N_value T + 2 N_reward T
      training    ppo_epochs x 6 (N_policy + N_value) T
    """
    tokens = args.batch * (prompt_mean + args.response_length)
    parts = {
        "generate": 2 * n_policy * tokens,
        "score": 2 * (2 * n_policy + n_value + n_reward) * tokens,
        "train": args.ppo_epochs * 6 * (n_policy + n_value) * tokens,
    }
    parts["total"] = sum(parts.values())
    return {"tokens_per_update_real": round(tokens, 1), **{k: float(v) for k, v in parts.items()}}


def prompt_mean_length(prompt_ids) -> float:
    return sum(len(p) for p in prompt_ids) / len(prompt_ids)


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


def gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


class GpuMemory:
    """Per-update peak GPU memory: `mark()` at the end of each update reads the peaks since the
    last mark (or the start) and resets them. Does nothing without CUDA."""

    def __init__(self):
        self.on = torch.cuda.is_available()
        self.allocated: list[int] = []
        self.reserved: list[int] = []

    def reset(self) -> None:
        if self.on:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def mark(self) -> None:
        if self.on:
            torch.cuda.synchronize()
            self.allocated.append(torch.cuda.max_memory_allocated())
            self.reserved.append(torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()

    def fields(self) -> dict:
        """The peaks over the timed updates (all but the first, a warm-up, when there are more)."""
        if not self.on or not self.allocated:
            return {}
        a, r = self.allocated[1:] or self.allocated, self.reserved[1:] or self.reserved
        gib = 2**30
        return {
            "gpu_peak_allocated_gib": round(max(a) / gib, 3),
            "gpu_peak_reserved_gib": round(max(r) / gib, 3),
            "gpu_peak_allocated_first_update_gib": round(self.allocated[0] / gib, 3),
            "gpu_total_gib": round(torch.cuda.get_device_properties(0).total_memory / gib, 2),
        }


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
        "gpu": gpu_name(),
        "cuda": torch.version.cuda,
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
