"""FSDP2 (`memory.sharding: fsdp2`) on CPU with gloo: 2 sharded processes compute what 1 unsharded
process computes, and a sharded rollout whose processes stop at different steps finishes."""

import json
import sys
from pathlib import Path

import pytest

from conftest import assert_same_metrics, launch_two, stable

HERE = Path(__file__).parent


@pytest.mark.timeout(600)
def test_two_sharded_processes_compute_what_one_unsharded_process_does(tiny_path, tmp_path):
    sys.path.insert(0, str(HERE))
    from fsdp2_run import run

    # Value clipping off: a reduce-scatter sums in another order than one process does, and at
    # the third iteration that round-off once moved a value across the clip boundary (value/clipfrac
    # 1/144 against 0). Every other metric then agrees to 1e-4.
    extra = {"critic.clip": None}
    out = tmp_path / "two.json"
    launch_two("fsdp2_run.py", tmp_path / "run2", 1, out, "fsdp2", json.dumps(extra))
    two = json.loads(out.read_text())
    one = run(str(tmp_path / "run1"), 2, "none", extra)
    assert (two["processes"], one["processes"]) == (2, 1)
    # each process holds about half of the weights, gradients and AdamW moments (dim-0 shards,
    # the odd row padded) of the policy and the critic
    assert 0.45 < two["held_bytes"] / one["held_bytes"] < 0.55, (two["held_bytes"], one["held_bytes"])
    assert_same_metrics(one["history"], two["history"], 3)
    import torch

    a, b = (torch.load(tmp_path / run / "weights.pt") for run in ("run1", "run2"))
    full = dict(b)
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith("attn.c_attn.bias"):
            # the keys' bias has a zero gradient in exact arithmetic (softmax ignores a shift
            # shared by a query's scores), so AdamW turns the two runs' different round-off
            # into steps of up to lr: 12 steps of lr 3e-4 bound it; the query and value biases agree
            d = a[name].shape[0] // 3
            torch.testing.assert_close(b[name][d : 2 * d], a[name][d : 2 * d], rtol=0, atol=12 * 3e-4)
            a[name], b[name] = torch.cat([a[name][:d], a[name][2 * d :]]), torch.cat([b[name][:d], b[name][2 * d :]])
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    from transformers import AutoModelForCausalLM  # the exported policy is a plain folder, with the trained weights

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run2" / "policy").state_dict()
    assert exported.keys() == full.keys()
    for name in full:
        torch.testing.assert_close(exported[name], full[name], rtol=0, atol=0, msg=name)


@pytest.mark.timeout(600)
def test_lora_chunked_logprobs_a_shared_critic_and_a_reward_model_sharded_compute_what_one_unsharded_process_does(tiny_path, tiny_reward_path, tmp_path):
    """The adapter trained over a sharded frozen base, the LM head applied chunk by chunk outside
    the forward, the value head on the shared LM, the reward model's backbone sharded; the merged
    export is rebuilt from the gathered weights (a sharded model cannot be deep-copied) and
    equals the unsharded run's."""
    sys.path.insert(0, str(HERE))
    from fsdp2_run import run

    extra = {"critic.clip": None, "lora.r": 4, "memory.logprob_chunk": 5, "critic.design": "shared", "reward.source": str(tiny_reward_path)}
    out = tmp_path / "two.json"
    launch_two("fsdp2_run.py", tmp_path / "run2", 1, out, "fsdp2", json.dumps(extra))
    two = json.loads(out.read_text())
    one = run(str(tmp_path / "run1"), 2, "none", extra)
    assert 0.45 < two["held_bytes"] / one["held_bytes"] < 0.55, (two["held_bytes"], one["held_bytes"])
    assert 0.45 < two["reward_bytes"] / one["reward_bytes"] < 0.55, (two["reward_bytes"], one["reward_bytes"])
    assert_same_metrics(one["history"], two["history"], 3)
    import torch
    from transformers import AutoModelForCausalLM

    merged = [AutoModelForCausalLM.from_pretrained(tmp_path / run / "policy").state_dict() for run in ("run1", "run2")]
    assert merged[0].keys() == merged[1].keys() and not any("lora" in k for k in merged[1])
    for name in merged[0]:
        torch.testing.assert_close(merged[1][name], merged[0][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(300)
def test_a_sharded_rollout_with_uneven_stops_finishes_and_issues_no_collective_while_decoding(tiny_path, tmp_path):
    out = tmp_path / "rollout.json"
    launch_two("fsdp2_rollout.py", out, timeout=240)
    ranks = {r["rank"]: r for r in json.loads(out.read_text())}
    assert ranks[1]["steps"] == 1 and ranks[0]["steps"] > 1  # the processes took different numbers of steps
    assert ranks[0]["inside"] == ranks[1]["inside"] == 0  # no collective inside the decode loop
    assert ranks[0]["forward_outside"] > 0  # (the spy does see a sharded forward's all-gathers)


@pytest.mark.timeout(600)
def test_a_sharded_checkpoint_resumes_exactly_and_loads_on_one_process(tiny_path, tmp_path):
    sys.path.insert(0, str(HERE))
    from fsdp2_resume import SETTINGS

    from ppo_lab import PPOConfig, PPOTrainer

    out = tmp_path / "resume.json"
    launch_two("fsdp2_resume.py", tmp_path / "run", out)
    result = json.loads(out.read_text())
    # on the same world size: the resumed third iteration is the unbroken one, to the bit
    assert stable(result["resumed"]) == stable(result["unbroken"])
    assert result["same_weights"]
    checkpoint = Path(result["checkpoint"])
    assert (checkpoint / "sharded").is_dir() and not (checkpoint / "policy.safetensors").exists()
    # on one process without sharding (2 micro-batches, the 2 processes' split): the shards are
    # put together, and the run goes on alike
    one = PPOTrainer(PPOConfig(**SETTINGS, **{
        "run.output_dir": str(checkpoint.parent.parent), "run.resume_from": str(checkpoint), "batch.accumulation_steps": 2,
    }))
    assert one.iteration == 2
    row = one.train()[-1]
    for key, value in stable(result["unbroken"]).items():
        assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.timeout(600)
def test_each_process_peak_memory_is_within_25_percent_of_the_estimate(tiny_path, tmp_path):
    """`estimate_memory(..., sharding="fsdp2")` against `measure_iteration` on each of 2 sharded
    processes (`TensorMemory` counts a DTensor's local shard and FSDP2's gathered weights,
    which it frees and gathers again by resizing their storage)."""
    out = tmp_path / "memory.json"
    launch_two("fsdp2_memory.py", tmp_path / "runs", out, timeout=540)
    rows = json.loads(out.read_text())
    assert len(rows) == 8 and {r["rank"] for r in rows} == {0, 1}
    for r in rows:
        assert r["est_rollout"] == pytest.approx(r["rollout"], rel=0.25), r["case"]
        assert r["est_update"] == pytest.approx(r["update"], rel=0.25), r["case"]


@pytest.mark.timeout(900)
def test_the_switches_run_sharded_with_evaluation_checkpoints_and_resume(tiny_path, tiny_reward_path, tmp_path):
    out = tmp_path / "switches.json"
    launch_two("fsdp2_switches.py", tmp_path / "runs", out, tiny_reward_path, timeout=840)
    results = json.loads(out.read_text())
    assert len(results) == 9
    for name, r in results.items():
        assert r["iterations"] == [1, 2] and min(r["steps"]) >= 1, name
        assert r["eval"] and r["policy_saved"] and r["resumed_at"] == 2 and r["kl_coef_equal"] and r["same_weights"], name
        assert r["score_map"] == r["resumed_score_map"], name
        if name.startswith("bf16"):
            assert r["first_kl"] == 0.0, name  # policy and reference sharded under one bf16 policy
        if "lora" not in name:
            # a wholly frozen model all in bf16 under bf16 (memory.frozen_weights: auto: as FSDP2 computes), else float32
            assert r["frozen_dtypes"] == (["torch.bfloat16"] if name.startswith("bf16") else ["torch.float32"]), name
    # a LoRA base under bf16: its linear layers in bf16, its embeddings and norms float32 (so its merged export keeps them exact)
    assert results["bf16, lora, shared critic"]["frozen_dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert results["chunked log-probs, lora"]["frozen_dtypes"] == ["torch.float32"]
    assert results["reference score norm, shared critic"]["score_map"] != [1.0, 0.0]  # fitted from the reference's samples


def test_sharding_refuses_the_switches_it_does_not_run_with_yet():
    from ppo_lab import PPOConfig

    for setting in ({"sampler.noise": 0.1}, {"memory.compile": True}, {"sampling.decode": "cuda_graph"}):
        with pytest.raises(ValueError, match=f"memory.sharding = 'fsdp2' does not run with {next(iter(setting))}"):
            PPOConfig(**{"memory.sharding": "fsdp2", **setting})


def test_an_encoder_reward_model_is_left_whole_under_fsdp2(tiny_path, tmp_path):
    """A BERT-style reward model reads its head inside its forward, and transformers names no
    blocks of several encoders for sharding: it stays whole on every process, its linear layers
    in bf16 as unsharded (they run under autocast)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from conftest import small_config
    from ppo_lab import PPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        num_labels=1, pad_token_id=tokenizer.pad_token_id)
    BertForSequenceClassification(config).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    trainer = PPOTrainer(small_config(tmp_path, {"memory.sharding": "fsdp2", "memory.precision": "bf16", "reward.source": str(tmp_path / "bert")}))
    history = trainer.train()
    model = trainer.reward_fn.model
    assert not any(hasattr(p, "to_local") for p in model.parameters())  # not sharded
    assert model.bert.encoder.layer[0].attention.self.query.weight.dtype == torch.bfloat16
    assert model.bert.embeddings.word_embeddings.weight.dtype == torch.float32 and model.classifier.weight.dtype == torch.bfloat16
    assert history[0]["objective/kl"] == 0.0 and len(history) == 2


@pytest.mark.timeout(300)
def test_a_world_of_one_is_not_inherited_by_processes_launched_after_it(tiny_path, tmp_path):
    """A sharded trainer in one process (a notebook) makes its own process group of one; the
    processes `launch_processes` forks afterwards would inherit it and hang."""
    import torch.distributed as dist

    from conftest import small_config
    from ppo_lab.distributed import launch_processes
    from ppo_lab.trainer import PPOTrainer

    sys.path.insert(0, str(HERE))
    from test_distributed import _one_update

    PPOTrainer(small_config(tmp_path, {"memory.sharding": "fsdp2", "run.iterations": 1})).iterate()
    assert dist.is_initialized() and dist.get_world_size() == 1
    launch_processes(_one_update, (str(tmp_path / "two"), 1), num_processes=2)
    assert json.loads((tmp_path / "two" / "result.json").read_text())["processes"] == 2
