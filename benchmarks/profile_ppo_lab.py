#!/usr/bin/env python3
"""Where one ppo_lab PPO update spends its time, next to the floor's equivalent pieces.

Builds the benchmark's workload (workload.py), a `ppo_lab.PPOTrainer` the way ppo_lab_run.py
does and the floor of floor.py, then runs one iteration of each in turn (`--warmup` pairs, then
`--iterations` timed pairs, so that the machine's drifts hit both alike), with wall-clock timers
wrapped around the functions they call (a timer includes whatever it calls, so nested rows are
parts of their parent row):

  rollout      model.generate, prompt tokenization, the policy / reference / critic scoring
               forwards, log-probs, entropy, decode, the reward's re-tokenize and forward
  advantages   score adjustment, reward shaping, the estimator, whitening
  update       per minibatch: policy forward, log-softmax / gather, critic forward, policy and
               value loss (with their metrics), backward, gradient clipping, optimizer step,
               scheduler step, zero_grad; then the metric reduction (torch.stack + .item())
  step tail    the per-iteration metrics of `iterate()` (KL, .item() calls)

The floor (floor.py's loop) is timed piece by piece in the same categories. Optionally
(`--cprofile`, `--torch-profile`) one more iteration of each runs under cProfile (Python
functions, file:line) and torch.profiler (aten operators). Prints a markdown report and writes
it, with a JSON of the numbers, to `--out`.

    PYTHONPATH=/path/to/checkout python benchmarks/profile_ppo_lab.py --critic both
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import workload as wl  # sets the offline environment before transformers is imported

import torch

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_workload_args(p)
    p.add_argument("--critic", choices=["separate", "shared", "both"], default="both")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iterations", type=int, default=5, help="timed iterations (medians are reported)")
    p.add_argument("--cprofile", action="store_true", help="also run one iteration under cProfile")
    p.add_argument("--torch-profile", action="store_true", help="also run one iteration under torch.profiler")
    p.add_argument("--out", default=str(HERE / "results"), help="folder for the report (.md) and numbers (.json)")
    p.set_defaults(updates=0)
    return p.parse_args(argv)


class Timers:
    """Accumulated wall time per label within one iteration; `close()` files the iteration."""

    def __init__(self):
        self.cur: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.iters: list[dict[str, float]] = []
        self.order: list[str] = []

    def add(self, label, seconds):
        if label not in self.order:
            self.order.append(label)
        self.cur[label] += seconds
        self.calls[label] += 1

    def wrap(self, label, fn):
        def timed(*a, **k):
            name = label if isinstance(label, str) else label(*a, **k)
            if name is None:  # a call this label function does not want timed
                return fn(*a, **k)
            if name not in self.order:  # rows are listed in the order their calls start
                self.order.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, time.perf_counter() - t0)

        timed.__wrapped__ = fn
        return timed

    def close(self):
        self.iters.append(dict(self.cur))
        self.cur.clear()

    def medians(self):
        return {k: statistics.median(it.get(k, 0.0) for it in self.iters) for k in self.order}

    def calls_per_iter(self):
        n = max(len(self.iters), 1)
        return {k: self.calls[k] / n for k in self.order}


class TimedCallable:
    """A stand-in for an object whose call is timed; every other attribute is the object's."""

    def __init__(self, obj, label, timers):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_call", timers.wrap(label, obj))

    def __call__(self, *a, **k):
        return self._call(*a, **k)

    def __getattr__(self, name):
        return getattr(self._obj, name)

    def __setattr__(self, name, value):
        setattr(self._obj, name, value)


# --------------------------------------------------------------------------------------------
def build_trainer(args, critic: str, tmp: Path):
    from ppo_lab import PPOConfig, PPOTrainer
    import dataclasses

    tok, words = wl.make_tokenizer(args.vocab, args.seed)
    texts = wl.make_prompt_texts(words, args.n_prompts, args.prompt_min, args.prompt_max, args.seed)
    policy = wl.no_dropout(wl.make_policy(tok, args))
    reward_dir = tmp / f"reward-{critic}"
    wl.make_reward_model(tok, args).save_pretrained(reward_dir)
    tok.save_pretrained(reward_dir)
    extra = {"sampling.ignore_eos": True, "optim.early_stop_kl": None}  # every update runs all its epochs, as in TRL
    if critic == "separate":
        critic_dir = tmp / "value"
        wl.make_value_model(tok, args).save_pretrained(critic_dir)
        tok.save_pretrained(critic_dir)
        extra["critic.model"] = str(critic_dir)
    config = PPOConfig(**extra, **{
            "critic.design": critic, "reward.source": str(reward_dir), "batch.rollout": args.batch,
            "batch.minibatch": args.batch // args.mini_batches, "batch.epochs": args.ppo_epochs,
            "sampling.max_new_tokens": args.response_length, "optim.lr": args.lr,
            "sampling.temperature": args.temperature, "kl.coef": args.kl_coef, "run.iterations": 1000,
            "run.eval_interval": 0, "run.progress_bar": False, "run.seed": args.seed,
            "run.output_dir": str(tmp / f"run-{critic}"),
        })
    return PPOTrainer(config, policy=policy, tokenizer=tok, train_prompts=texts), bool(extra.get("sampling.ignore_eos"))


def instrument_ppo_lab(trainer, timers: Timers):
    """Wrap the functions and methods one iteration calls (module globals and instance attributes)."""
    import ppo_lab.objective as objective_mod
    import ppo_lab.rollout as rollout_mod
    import ppo_lab.sampling as sampling_mod
    import ppo_lab.trainer as trainer_mod

    T = timers.wrap
    ref = trainer.reference

    # rollout ---------------------------------------------------------------------------------
    trainer.rollout = T("rollout", trainer.rollout)
    if hasattr(trainer_mod, "sample"):  # ppo_lab >= 7161211: the loop may also return log-probs and values
        trainer_mod.sample = T("rollout/generate", trainer_mod.sample)
    else:
        trainer_mod.generate = T("rollout/generate", trainer_mod.generate)
    lm = trainer.lm
    if hasattr(sampling_mod, "sample_tokens"):  # ppo_lab's own sampling loop
        lm.forward = T(lambda *a, **k: "rollout/generate/model forward (KV cache)" if k.get("use_cache") else None,
                       lm.forward)
        sampling_mod.sample_tokens = T("rollout/generate/sample_tokens", sampling_mod.sample_tokens)
    else:  # transformers' generate()
        lm.generate = T("rollout/generate/model.generate", lm.generate)
    trainer_mod.score_tokens = T("rollout/score_tokens", trainer_mod.score_tokens)
    rollout_mod.response_logits = T(
        lambda model, *a, **k: "rollout/score_tokens/reference forward" if model is ref
        else "rollout/score_tokens/policy forward", rollout_mod.response_logits)
    rollout_mod.logprobs_from_logits = T("rollout/score_tokens/logprobs_from_logits (policy + ref)",
                                         rollout_mod.logprobs_from_logits)
    rollout_mod.entropy_from_logits = T("rollout/score_tokens/entropy_from_logits", rollout_mod.entropy_from_logits)
    rollout_mod.critic_values = T("rollout/score_tokens/critic forward", rollout_mod.critic_values)
    trainer.tokenizer.batch_decode = T("rollout/decode responses", trainer.tokenizer.batch_decode)
    reward = trainer.reward_fn
    trainer.reward_fn = TimedCallable(reward, "rollout/reward (decode excluded)", timers)
    if hasattr(reward, "tokenizer") and hasattr(reward, "model"):
        reward.tokenizer = TimedCallable(reward.tokenizer, "rollout/reward (decode excluded)/re-tokenize", timers)
        reward.model = TimedCallable(reward.model, "rollout/reward (decode excluded)/reward forward", timers)
    trainer_mod.check_scores = T("rollout/check_scores", trainer_mod.check_scores)

    # advantages ------------------------------------------------------------------------------
    trainer.advantages = T("advantages", trainer.advantages)
    objective_mod.adjust_scores = T("advantages/adjust_scores", objective_mod.adjust_scores)
    objective_mod.shape_rewards = T("advantages/shape_rewards", objective_mod.shape_rewards)
    trainer.objective.estimator = T("advantages/estimator (GAE)", trainer.objective.estimator)
    import ppo_lab.disagreements as choices_mod  # advantage whitening goes through Choices.whiten

    choices_mod.masked_whiten = T("advantages/masked_whiten", choices_mod.masked_whiten)

    # update ----------------------------------------------------------------------------------
    trainer.update = T("update", trainer.update)
    if hasattr(trainer, "minibatch_loss"):
        trainer.minibatch_loss = T("update/_loss", trainer.minibatch_loss)
    else:
        trainer._loss = T("update/_loss", trainer._loss)
    trainer_mod.response_logits = T("update/_loss/policy forward", trainer_mod.response_logits)
    trainer_mod.logprobs_from_logits = T("update/_loss/logprobs_from_logits", trainer_mod.logprobs_from_logits)
    trainer_mod.critic_values = T("update/_loss/critic forward", trainer_mod.critic_values)
    # the loss functions live in the trainer module up to the trainer refactor, in losses.py after it
    try:
        import ppo_lab.losses as loss_mod
    except ImportError:
        loss_mod = trainer_mod
    loss_mod.clipped_policy_loss = T("update/_loss/clipped_policy_loss (+ metrics)", loss_mod.clipped_policy_loss)
    loss_mod.clipped_value_loss = T("update/_loss/clipped_value_loss (+ metrics)", loss_mod.clipped_value_loss)
    acc = trainer.accelerator
    acc.backward = T("update/backward", acc.backward)
    acc.clip_grad_norm_ = T("update/clip_grad_norm_", acc.clip_grad_norm_)
    trainer.optimizer.step = T("update/optimizer.step", trainer.optimizer.step)
    trainer.optimizer.zero_grad = T("update/optimizer.zero_grad", trainer.optimizer.zero_grad)
    trainer.scheduler.step = T("update/scheduler.step", trainer.scheduler.step)
    real_stack = torch.stack

    class TorchProxy:  # the trainer module's `torch`, with stack timed (the metric reduction)
        def __getattr__(self, name):
            return getattr(torch, name)

        stack = staticmethod(T("update/metric reduction: torch.stack (x keys)", real_stack))

    trainer_mod.torch = TorchProxy()
    trainer.iterate = T("step (whole iteration)", trainer.iterate)


def op_counts(key_averages) -> dict:
    """{aten op: [calls, self CPU ms]} of one profiled iteration."""
    return {e.key: [e.count, round(e.self_cpu_time_total / 1000, 2)] for e in key_averages if e.key.startswith("aten::")}


def metric_reduction_seconds(n_keys: int, n_values: int, reps: int = 20) -> float:
    """Time of update()'s final `{k: torch.stack([v.float() ...]).mean().item()}` on same-sized input."""
    collected = {f"k{i}": [torch.tensor(0.5) for _ in range(n_values)] for i in range(n_keys)}
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        {k: torch.stack([v.float() for v in vs]).mean().item() for k, vs in collected.items()}
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def setup_ppo_lab(args, critic, tmp):
    """An instrumented trainer and its timers; `step()` runs (and times) one iteration."""
    trainer, ignore_eos = build_trainer(args, critic, tmp)
    timers = Timers()
    instrument_ppo_lab(trainer, timers)

    def step():
        metrics = trainer.iterate()
        timers.close()
        return metrics

    return trainer, timers, step, ignore_eos


def profile_ppo_lab_extras(args, trainer, timers, metrics, ignore_eos):
    out = {"ignore_eos": ignore_eos, "medians": timers.medians(), "calls_per_iteration": timers.calls_per_iter(),
           "update_metric_keys": sum(1 for k in metrics if k.startswith(("policy/", "value/", "loss/")))}
    out["metric_reduction_replay_s"] = metric_reduction_seconds(out["update_metric_keys"],
                                                                args.ppo_epochs * args.mini_batches)
    extras = {}
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        trainer.iterate()
        prof.disable()
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(45)
        extras["cprofile"] = s.getvalue()
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tp:
            trainer.iterate()
        ka = tp.key_averages()
        extras["torch_profile"] = ka.table(sort_by="self_cpu_time_total", row_limit=30)
        out["aten_ops_per_iteration"] = sum(e.count for e in ka if e.key.startswith("aten::"))
        out["aten_ops"] = op_counts(ka)
    return out, extras


# --------------------------------------------------------------------------------------------
def setup_floor(args, critic):
    """The floor (floor.py) with timers around its pieces; `step()` runs one update."""
    import floor as fl

    tok, words = wl.make_tokenizer(args.vocab, args.seed)
    texts = wl.make_prompt_texts(words, args.n_prompts, args.prompt_min, args.prompt_max, args.seed)
    f = fl.Floor(args, tok, wl.make_prompt_ids(tok, texts), critic)
    timers = Timers()
    T = timers.wrap
    f.generate = T("rollout/generate (sampling loop, log-probs from its logits)", f.generate)

    def by_grad(rollout_label, update_label):
        return lambda *a, **k: update_label if torch.is_grad_enabled() else rollout_label

    f.ref.forward = T("rollout/score/reference forward", f.ref.forward)
    if critic == "separate":
        f.value.transformer.forward = T(by_grad("rollout/score/critic forward", "update/critic forward"),
                                        f.value.transformer.forward)
    f.reward.transformer.forward = T("rollout/score/reward forward", f.reward.transformer.forward)
    f.score = T("rollout/score", f.score)
    f.advantages = T("advantages", f.advantages)

    def optimise(q, qm, r, old_lp, old_v, adv, ret, clip=0.2, vclip=0.2, vf_coef=0.5):
        a, P, B = args, q.shape[1], q.shape[0]
        mb = B // a.mini_batches
        ids, attn, pos = fl.full_sequence(q, qm, r)
        for _ in range(a.ppo_epochs):
            perm = torch.randperm(B)
            for s in range(0, B, mb):
                i = perm[s:s + mb]
                x, m, p, rr = ids[i], attn[i], pos[i], r[i]
                t0 = time.perf_counter()
                if critic == "separate":
                    logits = f.policy(input_ids=x, attention_mask=m, position_ids=p).logits[:, P - 1:-1]
                    timers.add("update/policy forward", time.perf_counter() - t0)
                    h = f.value.transformer(input_ids=x, attention_mask=m, position_ids=p).last_hidden_state  # timed
                    v = f.value.score(h[:, P - 1:-1]).squeeze(-1)
                    t2 = time.perf_counter()
                else:
                    out = f.policy(input_ids=x, attention_mask=m, position_ids=p, output_hidden_states=True)
                    logits = out.logits[:, P - 1:-1]
                    v = f.v_head(out.hidden_states[-1][:, P - 1:-1]).squeeze(-1)
                    t2 = time.perf_counter()
                    timers.add("update/policy forward (+ value head)", t2 - t0)
                lp = fl.token_logprobs(logits, rr, a.temperature)
                t3 = time.perf_counter()
                ratio = (lp - old_lp[i]).exp()
                pg = torch.max(-adv[i] * ratio, -adv[i] * ratio.clamp(1 - clip, 1 + clip)).mean()
                v_clipped = old_v[i] + (v - old_v[i]).clamp(-vclip, vclip)
                vf = 0.5 * torch.max((v - ret[i]).square(), (v_clipped - ret[i]).square()).mean()
                loss = pg + vf_coef * vf
                t4 = time.perf_counter()
                loss.backward()
                t5 = time.perf_counter()
                f.opt.step()
                t6 = time.perf_counter()
                f.opt.zero_grad(set_to_none=True)
                t7 = time.perf_counter()
                timers.add("update/log_softmax + gather", t3 - t2)
                timers.add("update/loss math", t4 - t3)
                timers.add("update/backward", t5 - t4)
                timers.add("update/optimizer.step", t6 - t5)
                timers.add("update/zero_grad", t7 - t6)

    f.optimise = T("update", optimise)
    f.args = argparse.Namespace(**{**vars(args), "updates": 1})
    real_opt = f.optimise

    def optimise_and_close(*a, **k):
        real_opt(*a, **k)
        timers.cur["rollout"] = sum(v for key, v in timers.cur.items() if key.count("/") == 1 and key.startswith("rollout/"))
        timers.close()

    f.optimise = optimise_and_close
    whole: list[float] = []

    def step():
        whole.append(f.run()["update_s"][0])

    return f, timers, step, whole


def profile_floor_extras(args, f, timers, whole):
    timers.order = ["rollout"] + [k for k in timers.order if k != "rollout"]
    med = {"step (whole iteration)": statistics.median(whole), **timers.medians()}
    out = {"medians": med, "calls_per_iteration": timers.calls_per_iter()}
    extras = {}
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tp:
            f.run()
        ka = tp.key_averages()
        extras["torch_profile"] = ka.table(sort_by="self_cpu_time_total", row_limit=30)
        out["aten_ops_per_iteration"] = sum(e.count for e in ka if e.key.startswith("aten::"))
        out["aten_ops"] = op_counts(ka)
    return out, extras


def profile_pair(args, critic, tmp):
    """ppo_lab and the floor, one iteration each in turn, so that the machine's drifts hit both alike."""
    trainer, pl_timers, pl_step, ignore_eos = setup_ppo_lab(args, critic, tmp)
    f, fl_timers, fl_step, whole = setup_floor(args, critic)
    for _ in range(args.warmup):
        pl_step()
        fl_step()
    for t in (pl_timers, fl_timers):
        t.iters.clear()
        t.calls.clear()
    whole.clear()
    metrics = None
    for _ in range(args.iterations):
        metrics = pl_step()
        fl_step()
    pl, pl_extra = profile_ppo_lab_extras(args, trainer, pl_timers, metrics, ignore_eos)
    fl_, fl_extra = profile_floor_extras(args, f, fl_timers, whole)
    return pl, fl_, {"ppo_lab": pl_extra, "floor": fl_extra}


# --------------------------------------------------------------------------------------------
def report(results, args) -> str:
    lines = [f"# Profile of one PPO iteration: ppo_lab vs the floor",
             "",
             f"Workload: batch {args.batch} x {args.response_length} new tokens, {args.ppo_epochs} epochs x "
             f"{args.mini_batches} minibatches, {args.threads} torch thread(s). ppo_lab and the floor alternate, one "
             f"iteration each; medians over {args.iterations} iterations after {args.warmup} warm-up ones; times in milliseconds per iteration (sums over the "
             f"calls in it). Indented rows are parts of the row above them.", ""]
    for critic, r in results.items():
        pl, fl_ = r["ppo_lab"]["medians"], r["floor"]["medians"]
        calls = r["ppo_lab"]["calls_per_iteration"]
        src = r.get("ppo_lab_source", {})
        lines += [f"## critic = {critic}", "",
                  f"ppo_lab from {src.get('path')} ({src.get('commit', '?')}), ignore_eos={r['ppo_lab']['ignore_eos']}; "
                  f"aten ops per iteration: ppo_lab {r['ppo_lab'].get('aten_ops_per_iteration', 'n/a')}, "
                  f"floor {r['floor'].get('aten_ops_per_iteration', 'n/a')}", "",
                  "| ppo_lab | calls | ms |", "|---|---:|---:|"]
        for k, v in pl.items():
            depth = k.count("/")
            name = k.rsplit("/", 1)[-1]
            lines.append(f"| {'&nbsp;' * 4 * depth}{name} | {calls.get(k, 0):g} | {v * 1000:.1f} |")
        lines.append(f"| (replay of the metric reduction alone: {r['ppo_lab']['update_metric_keys']} keys x "
                     f"{args.ppo_epochs * args.mini_batches} values) | | {r['ppo_lab']['metric_reduction_replay_s'] * 1000:.1f} |")
        if "aten_ops" in r["ppo_lab"] and "aten_ops" in r["floor"]:
            a, b = r["ppo_lab"]["aten_ops"], r["floor"]["aten_ops"]
            diff = sorted(((a.get(k, [0, 0])[0] - b.get(k, [0, 0])[0], k) for k in set(a) | set(b)), reverse=True)[:12]
            lines += ["", "aten operators that ppo_lab calls more often than the floor (one profiled iteration):", "",
                      "| operator | ppo_lab calls | floor calls | ppo_lab self ms | floor self ms |", "|---|---:|---:|---:|---:|"]
            for d, k in diff:
                pa, pb = a.get(k, [0, 0.0]), b.get(k, [0, 0.0])
                lines.append(f"| {k} | {pa[0]} | {pb[0]} | {pa[1]:.1f} | {pb[1]:.1f} |")
        lines += ["", "| floor | ms |", "|---|---:|"]
        for k, v in fl_.items():
            depth = k.count("/")
            lines.append(f"| {'&nbsp;' * 4 * depth}{k.rsplit('/', 1)[-1]} | {v * 1000:.1f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    wl.setup_process(args)
    import ppo_lab

    from ppo_lab_run import source_of

    critics = ["separate", "shared"] if args.critic == "both" else [args.critic]
    results, extras = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_profile_") as tmp:
        for critic in critics:
            pl, fl_, extras[critic] = profile_pair(args, critic, Path(tmp))
            results[critic] = {"ppo_lab": pl, "floor": fl_, "ppo_lab_source": source_of(ppo_lab)}
    text = report(results, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"profile-{stamp}.md").write_text(text)
    (out / f"profile-{stamp}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    detail = []
    for critic, ex in extras.items():
        for who, d in ex.items():
            for kind, body in d.items():
                detail.append(f"===== {critic} / {who} / {kind}\n{body}")
    if detail:
        (out / f"profile-{stamp}.detail.txt").write_text("\n".join(detail))
    print(text)
    print(f"written: {out / f'profile-{stamp}.md'}", flush=True)


if __name__ == "__main__":
    main()
