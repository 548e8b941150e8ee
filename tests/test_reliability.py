"""Bad input and faults, as a new user meets them: never silently wrong, never a raw traceback
for an expected error, never two runs mixed in one folder."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import small_config
import ppo_lab.run_output
from ppo_lab.trainer import NonFiniteError, PPOTrainer


def _cli(args, cwd, **env):
    env = {**{k: v for k, v in os.environ.items() if k != "PPO_LAB_TRACEBACK"}, "HF_HUB_OFFLINE": "1", **env}
    # -P: the working directory is not put on sys.path by Python itself (as with the ppo-lab script)
    return subprocess.run([sys.executable, "-P", "-m", "ppo_lab.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


SMALL = ["--batch.rollout", "16", "--batch.minibatch", "8", "--batch.epochs", "1", "--sampling.max_new_tokens", "6", "--run.progress_bar", "false", "--threads", "1"]


def _one_clear_line(out, code, *fragments):
    assert out.returncode == code, (out.returncode, out.stderr[-2000:])
    lines = [line for line in out.stderr.splitlines() if line.strip() and "Warning" not in line and not line.startswith(" ")]
    assert lines[-1].startswith("ppo-lab: error: "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])


# --- two runs in one folder -------------------------------------------------------------
def test_overwriting_a_run_removes_all_of_it_and_a_resume_continues_the_new_run(tiny_path, tmp_path):
    PPOTrainer(small_config(tmp_path, {"run.iterations": 4, "run.save_interval": 1})).train()
    run = tmp_path / "run"
    (run / "policy.old-123").mkdir()  # leftovers of an interrupted save go too
    new = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "run.save_interval": 1, "run.overwrite": True, "run.seed": 5}))
    new.train(1)
    assert not (run / "policy").exists() and not (run / "policy.old-123").exists()  # the old run's final policy is gone
    assert json.loads((run / "run.json").read_text()) == {"run_id": new.run_id, "files": list(ppo_lab.run_output.RUN_FILES)}
    new.train()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-000001", "checkpoint-000002"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    resumed = PPOTrainer(small_config(tmp_path, {"run.iterations": 3, "run.save_interval": 1, "run.seed": 5, "run.resume_from": "latest"}))
    assert resumed.iteration == 2 and resumed.run_id == new.run_id
    resumed.train()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]


def test_a_checkpoint_of_another_run_is_refused(tiny_path, tmp_path):
    PPOTrainer(small_config(tmp_path / "a", {"run.iterations": 1, "run.save_interval": 1})).train()
    PPOTrainer(small_config(tmp_path / "b", {"run.iterations": 1})).train()
    other = tmp_path / "a" / "run" / "checkpoints" / "checkpoint-000001"
    with pytest.raises(ValueError, match=r"belongs to another run than the one in run.output_dir"):
        PPOTrainer(small_config(tmp_path / "b", {"run.iterations": 2, "run.resume_from": str(other)}))


def test_an_occupied_output_dir_is_refused_before_any_model_is_loaded(tiny_path, tmp_path, monkeypatch):
    PPOTrainer(small_config(tmp_path, {"run.iterations": 1})).train()

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the output_dir was checked")

    monkeypatch.setattr("ppo_lab.models.load_pretrained", no_loading)
    with pytest.raises(ValueError, match=r"already holds a run \(metrics.jsonl\)"):
        PPOTrainer(small_config(tmp_path, {"run.iterations": 1}))


def test_an_unwritable_output_dir_is_refused_at_start(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"run.output_dir '.*a_file/run' cannot be written"):
        PPOTrainer(small_config(tmp_path, {"run.output_dir": str(tmp_path / "a_file" / "run")}))
    with pytest.raises(ValueError, match=r"run.output_dir '.*a_file' is a file, not a folder"):
        PPOTrainer(small_config(tmp_path, {"run.output_dir": str(tmp_path / "a_file")}))


def test_a_killed_final_save_leaves_the_previous_policy(tiny_path, tmp_path):
    # killed between its two renames: the previous policy is policy.old-*, the new one policy.tmp-*
    first = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "run.save_interval": 1}))
    first.train()
    run = tmp_path / "run"
    (run / "policy").rename(run / "policy.old-999")
    (run / "policy.tmp-999").mkdir()
    resumed = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "run.resume_from": "latest"}))
    resumed.train(0)
    assert (run / "policy" / "config.json").exists()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("policy")) == ["policy"]


def test_a_torn_last_metrics_row_is_dropped_on_resume(tiny_path, tmp_path):
    PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "run.save_interval": 1})).train()
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"iteration": 2, "reward/sc')  # killed mid-write
    PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "run.resume_from": "latest"})).train()
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_a_torn_row_of_the_checkpoints_own_iteration_is_written_back_from_the_checkpoint(tiny_path, tmp_path):
    PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "run.save_interval": 1})).train()
    metrics = tmp_path / "run" / "metrics.jsonl"
    first, second = metrics.read_text().splitlines()
    metrics.write_text(first + "\n" + second[:20])  # the row of iteration 2, the newest checkpoint's, torn
    PPOTrainer(small_config(tmp_path, {"run.iterations": 3, "run.resume_from": "latest"})).train()
    rows = metrics.read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in rows] == [1, 2, 3]
    assert rows[:2] == [first, second]  # written back as it was logged


# --- broken weights are never saved as a result ---------------------------------------------
def test_weights_that_become_nan_stop_the_run_and_nothing_is_saved(tiny_path, tmp_path, monkeypatch):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 3, "run.save_interval": 1}))
    step = trainer.optimizer.step

    def poisoned_step(*args, **kwargs):
        step(*args, **kwargs)
        if trainer.iteration == 1:  # during the second iteration's update
            with torch.no_grad():
                next(iter(trainer.trained_parameters())).fill_(float("inf"))

    monkeypatch.setattr(trainer.optimizer, "step", poisoned_step)
    with pytest.raises(NonFiniteError, match=r"iteration 2: the weights are nan or inf after the update .*the final policy is not saved; the newest checkpoint is .*checkpoint-000001"):
        trainer.train()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["checkpoint-000001"]
    assert not (tmp_path / "run" / "policy").exists()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]  # the failed iteration's metrics are kept


def test_sampling_from_nan_logits_is_an_error(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path))
    with torch.no_grad():
        for p in trainer.lm.parameters():
            p.fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=r"logits are nan or inf at generated token 0"):
        trainer.evaluate(2)
    with pytest.raises(NonFiniteError, match=r"logits are nan or inf at generated token 0"):
        trainer.train()  # in training too, with nothing logged or saved
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "policy").exists()


def test_masked_vocabulary_logits_are_not_an_error():
    # -inf logits are how models forbid tokens; only nan, +inf or a row with nothing finite is refused
    from ppo_lab.sampling import Sampling, generate
    from ppo_lab.models import load_policy, load_tokenizer
    from ppo_lab.tiny import tiny_model_path

    model, tok = load_policy(str(tiny_model_path())).eval(), load_tokenizer(str(tiny_model_path()))
    forbidden = 7
    model.lm_head.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([forbidden]), float("-inf")))
    drawn = generate(model, tok, ["the pizza was"] * 4, Sampling(max_new_tokens=6, stop_ids=[tok.eos_token_id]))
    assert not (drawn.response_ids == forbidden).any()


# --- models that are not what they claim -----------------------------------------------
def test_a_causal_lm_given_as_reward_model_is_refused(tiny_path, tmp_path):
    # loaded as a sequence classifier it would get a random score head: training on noise
    with pytest.raises(ValueError, match=r"the reward model '.*' has no weights for score.weight in its checkpoint"):
        PPOTrainer(small_config(tmp_path, {"reward.source": str(tiny_path)}))


def test_a_truncated_model_file_is_named(tiny_path, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_path, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"could not load the policy model from '.*model' \(a local folder"):
        PPOTrainer(small_config(tmp_path, {"policy.model": str(folder)}))


def test_resuming_with_models_of_another_shape_is_a_clear_error(tiny_path, tmp_path):
    PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "run.save_interval": 1})).train()
    with pytest.warns(UserWarning, match="different configuration"):
        with pytest.raises(ValueError, match=r"checkpoint '.*checkpoint-000001' does not fit the models of this configuration: Missing key"):
            PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "lora.r": 4, "run.resume_from": "latest"}))
    # a model of another width under the same names: a size mismatch, named
    from transformers import GPT2LMHeadModel

    from ppo_lab.models import load_policy, load_tokenizer

    narrow = tmp_path / "narrow"
    config = load_policy(str(tiny_path)).config
    config.n_embd = 48
    GPT2LMHeadModel(config).save_pretrained(narrow)
    load_tokenizer(str(tiny_path)).save_pretrained(narrow)
    with pytest.warns(UserWarning, match="different configuration"):
        with pytest.raises(ValueError, match=r"does not fit the models of this configuration: size mismatch for "):
            PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "policy.model": str(narrow), "run.resume_from": "latest"}))



# --- saving ------------------------------------------------------------------------------
def test_a_full_disk_while_checkpointing_leaves_no_partial_folder(tiny_path, tmp_path, monkeypatch):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "run.save_interval": 1}))
    trainer.train(1)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(OSError, match=r"could not write checkpoint '.*checkpoint-000002' \(No space left on device\); the earlier checkpoints are intact \(the newest: checkpoint-000001\)"):
        trainer.train(1)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["checkpoint-000001"]


def test_a_full_disk_that_torch_reports_as_an_unexpected_pos_is_named_and_no_earlier_checkpoint_is_claimed(tiny_path, tmp_path, monkeypatch):
    import collections

    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "run.save_interval": 1}))

    def torch_full(*args, **kwargs):  # what torch.save's C++ writer raises on a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4310")

    monkeypatch.setattr("torch.save", torch_full)
    monkeypatch.setattr("shutil.disk_usage", lambda path: collections.namedtuple("usage", "total used free")(10**9, 10**9, 0))
    with pytest.raises(OSError, match=r"checkpoint-000001' \(no space left on the device: 0.0 MiB free; the writer said: \[enforce fail .*unexpected pos .*\); there is no earlier checkpoint"):
        trainer.train(1)


def test_the_final_policy_is_saved_atomically(tiny_path, tmp_path, monkeypatch):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1}))
    folder = trainer.save(tmp_path / "policy")
    before = sorted(p.name for p in folder.iterdir())

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer.tokenizer, "save_pretrained", fail)
    with pytest.raises(OSError, match=r"could not save the policy to '.*policy' \(No space left on device\); nothing was written there"):
        trainer.save(folder)
    assert sorted(p.name for p in folder.iterdir()) == before  # the previous save is intact
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


# --- the command line ----------------------------------------------------------------------
def test_cli_expected_errors_are_one_line_with_a_nonzero_code(tiny_path, tmp_path):
    (tmp_path / "broken.yaml").write_text("learning_rate: 1e-5\ncritic: [shared\n")
    _one_clear_line(_cli(["train", "broken.yaml"], tmp_path), 2, "config file 'broken.yaml' is not valid YAML at line")
    # a negative value reaches the config's range check (argparse took it for an option)
    _one_clear_line(_cli(["train", "--optim.lr", "-1e-4"], tmp_path), 2, "optim.lr = -0.0001 must be a finite number")
    _one_clear_line(_cli(["train", "--optim.lr", "inf"], tmp_path), 2, "optim.lr = inf must be a finite number")
    # a reward module in the working directory is importable; a wrong shape is named
    (tmp_path / "my_rewards.py").write_text("def short(prompts, responses):\n    return [0.0] * (len(responses) - 1)\n\ndef nan(prompts, responses):\n    return [float('nan')] * len(responses)\n")
    out = _cli(["train", *SMALL, "--reward.source", "my_rewards:short", "--run.output_dir", "r1"], tmp_path)
    _one_clear_line(out, 2, "reward my_rewards.short returned scores of shape (7,) for 8 responses; expected (8,)")
    out = _cli(["train", *SMALL, "--reward.source", "my_rewards:nan", "--run.output_dir", "r2", "--run.max_bad_updates", "2"], tmp_path)
    _one_clear_line(out, 1, "Stopping: run.max_bad_updates = 2 reached")
    # an output folder that holds a run (r2 logged its failed iterations)
    _one_clear_line(_cli(["train", *SMALL, "--run.output_dir", "r2"], tmp_path), 2, "already holds a run")
    # the full traceback on request
    out = _cli(["train", "broken.yaml", "--traceback"], tmp_path)
    assert out.returncode != 0 and "Traceback" in out.stderr
    out = _cli(["train", "broken.yaml"], tmp_path, PPO_LAB_TRACEBACK="1")
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_weights_that_explode_stop_the_run(tiny_path, tmp_path):
    # lr 5e4: finite weights of size ~5e4, which used to be saved as the final policy (exit 0)
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "optim.lr": 5e4, "optim.early_stop_kl": None}))
    with pytest.raises(NonFiniteError, match=r"iteration 1: the update multiplied the norm of the trained weights by .* they exploded \(optim.lr = 50000 is probably far too large\)"):
        trainer.train()
    assert not (tmp_path / "run" / "policy").exists()


# --- a run deletes only what a run wrote ------------------------------------------------
def _user_folder(folder):
    """A user's own folder, full of names a run of ppo_lab also writes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text("# my own settings, with comments\nlearning_rate: 1e-5\n")
    (folder / "ppo_lab").mkdir()
    (folder / "ppo_lab" / "__init__.py").write_text("# my source\n")
    (folder / "metrics.jsonl").write_text('{"iteration": 1, "mine": true}\n')
    (folder / "notes.txt").write_text("keep me\n")
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_folder_of_look_alike_names_is_refused_and_left_as_it_was(tiny_path, tmp_path):
    mine = tmp_path / "mine"
    before = _user_folder(mine)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"holds config.yaml, metrics.jsonl, ppo_lab, not written by a run of ppo_lab .*Choose a new or empty run.output_dir"):
            PPOTrainer(small_config(tmp_path, {"run.output_dir": str(mine), "run.overwrite": overwrite})).train()
        assert _files(mine) == before
    # from the command line, in the folder itself: one clear line, exit 2, nothing touched
    _one_clear_line(_cli(["train", *SMALL, "--run.iterations", "1", "--run.output_dir", "."], mine), 2, "not written by a run of ppo_lab")
    _one_clear_line(_cli(["train", *SMALL, "--run.iterations", "1", "--run.output_dir", ".", "--run.overwrite", "true"], mine), 2, "a run would write over them")
    assert _files(mine) == before
    _one_clear_line(_cli(["train", *SMALL, "--run.output_dir", ""], tmp_path), 2, "run.output_dir is empty")


def test_other_files_stay_beside_a_run_only_when_asked_and_an_overwrite_removes_only_the_old_runs_own(tiny_path, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me\n")
    with pytest.raises(ValueError, match=r"is not empty and holds no run of ppo_lab \(notes.txt\); .*set run.overwrite to write the run beside those files"):
        PPOTrainer(small_config(tmp_path, {"run.iterations": 1}))
    first = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "run.save_interval": 1, "run.overwrite": True}))
    first.train()
    assert (folder / "notes.txt").read_text() == "keep me\n"
    assert json.loads((folder / "run.json").read_text()) == {"run_id": first.run_id, "files": list(ppo_lab.run_output.RUN_FILES)}
    # a later file of the user's, with a name no run writes, survives an overwrite of the run
    (folder / "plot.png").write_bytes(b"\x89PNG")
    second = PPOTrainer(small_config(tmp_path, {"run.iterations": 1, "run.overwrite": True, "run.seed": 3}))
    second.train()
    assert (folder / "notes.txt").read_text() == "keep me\n" and (folder / "plot.png").read_bytes() == b"\x89PNG"
    assert not (folder / "checkpoints").exists()  # the first run's checkpoints went with it
    assert json.loads((folder / "run.json").read_text())["run_id"] == second.run_id


def test_a_run_json_that_does_not_list_a_runs_files_is_not_trusted(tiny_path, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"run_id": "x", "files": ["../elsewhere"]}))
    with pytest.raises(ValueError, match=r"run.json' does not list a run's files as ppo_lab writes them"):
        PPOTrainer(small_config(tmp_path, {"run.overwrite": True}))
    assert (folder / "run.json").exists()


@pytest.mark.parametrize("text, message", [("{not json", r"run.json' is not readable JSON"),
                                           ('["run_id", "x"]', r"run.json' holds JSON but not a run record \(a JSON object; found list\)")])
def test_a_run_json_that_is_not_a_record_is_named_for_what_it_is(tiny_path, tmp_path, text, message):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        PPOTrainer(small_config(tmp_path, {"run.overwrite": True}))
    assert (folder / "run.json").read_text() == text


# --- resume_from: a number, a name as ls shows it, a path that must exist -------------------
def test_resume_from_takes_an_iteration_or_a_checkpoint_name_and_a_named_path_must_exist(tiny_path, tmp_path, monkeypatch):
    PPOTrainer(small_config(tmp_path, {"run.iterations": 3, "run.save_interval": 1})).train()
    monkeypatch.chdir(tmp_path)  # "3" and "checkpoint-000002" are not folders here: they are looked up in output_dir
    for where, iteration in (("2", 2), ("checkpoint-000002", 2), ("3", 3)):
        assert PPOTrainer(small_config(tmp_path, {"run.iterations": 3, "run.resume_from": where})).iteration == iteration
    ckpts = str(tmp_path / "run" / "checkpoints")
    # a mistyped folder is an error that lists what there is, never the previous checkpoint
    with pytest.raises(ValueError, match=rf"resume_from = 'checkpoint-00003': there is no checkpoint folder 'checkpoint-00003'; the checkpoints in '{ckpts}' are: checkpoint-000003, checkpoint-000002"):
        PPOTrainer(small_config(tmp_path, {"run.iterations": 4, "run.resume_from": "checkpoint-00003"}))
    with pytest.raises(ValueError, match=r"run.resume_from = '7': there is no checkpoint folder '.*checkpoint-000007'"):
        PPOTrainer(small_config(tmp_path, {"run.iterations": 9, "run.resume_from": "7"}))
    # the final policy is a saved model, not a checkpoint (it used to be called "incomplete")
    with pytest.raises(ValueError, match=r"'.*run/policy' is a saved model, not a checkpoint .*policy.model = "):
        PPOTrainer(small_config(tmp_path, {"run.iterations": 4, "run.resume_from": str(tmp_path / "run" / "policy")}))


def test_a_manifest_entry_without_its_checksum_is_a_corrupt_checkpoint_and_the_previous_one_is_used(tiny_path, tmp_path):
    from ppo_lab import checkpoint as ckpt

    PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "run.save_interval": 1})).train()
    newest = tmp_path / "run" / "checkpoints" / "checkpoint-000002"
    manifest = json.loads((newest / "manifest.json").read_text())
    del next(iter(manifest["files"].values()))["sha256"]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match=r"unreadable manifest.json \(every file needs its bytes and sha256\)"):
        ckpt.verify_checkpoint(newest)
    with pytest.warns(UserWarning, match=r"checkpoint-000002' has an unreadable manifest.json"):
        assert PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "run.resume_from": "latest"})).iteration == 1


def test_a_seed_outside_numpys_range_is_named_by_the_config():
    from ppo_lab.config import PPOConfig

    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match=rf"run.seed = {bad}"):
            PPOConfig(**{"run.seed": bad})
    assert PPOConfig(**{"run.seed": 2**32 - 1}).run.seed == 2**32 - 1


def test_prompts_given_as_one_string_an_empty_evaluation_set_and_a_reward_that_is_not_a_function_are_named(tiny_path, tmp_path):
    with pytest.raises(ValueError, match=r"train_prompts is one string \('the food was'\); give a list of prompts"):
        PPOTrainer(small_config(tmp_path), train_prompts="the food was", reward_fn=lambda p, r: [0.0] * len(r))
    with pytest.raises(ValueError, match=r"eval_prompts is empty: give at least one evaluation prompt"):
        PPOTrainer(small_config(tmp_path), eval_prompts=[])
    with pytest.raises(ValueError, match=r"reward_fn = 42 is not callable"):
        PPOTrainer(small_config(tmp_path), reward_fn=42)
    with pytest.raises(ValueError, match=r"evaluation prompt 1 is None: every prompt must be a non-empty string"):
        PPOTrainer(small_config(tmp_path), eval_prompts=["fine", None])


def test_asking_to_evaluate_more_prompts_than_the_run_has_is_refused(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path), eval_prompts=["the food was", "the film was", "the trip was"])
    for bad in (4, 0, -1):
        with pytest.raises(ValueError, match=rf"evaluate\(n={bad}\): this run has 3 evaluation prompts; ask for 1 to 3"):
            trainer.evaluate(bad)
    assert [s["prompt"] for s in trainer.evaluate(3)] == ["the food was", "the film was", "the trip was"]
    assert len(trainer.evaluate()) == 3  # run.eval_count (16) is a cap, not a demand


def test_a_label_index_the_reward_model_lacks_is_named_when_it_loads(tiny_path, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ppo_lab.rewards import SequenceClassifierReward

    AutoModelForSequenceClassification.from_pretrained(str(tiny_path), num_labels=2).save_pretrained(tmp_path / "rm2")
    AutoTokenizer.from_pretrained(str(tiny_path)).save_pretrained(tmp_path / "rm2")
    for bad in (7, -3):  # used to be an IndexError at the first rollout
        with pytest.raises(ValueError, match=rf"reward.label_index = {bad}, but the reward model '.*rm2' has 2 labels \(valid: -2 to 1\)"):
            SequenceClassifierReward(str(tmp_path / "rm2"), label_index=bad)
    assert SequenceClassifierReward(str(tmp_path / "rm2"), label_index=-2).label_index == -2


def test_a_short_or_mistyped_flag_points_to_the_field(tmp_path):
    for flag, want in (("--optim.learn", "--optim.lr"), ("--lr", "--optim.lr"), ("--iterations", "--run.iterations"), ("--kl.coeff", "--kl.coef"), ("--optim.max-grad", "--optim.max_grad_norm")):
        out = _cli(["train", flag, "1e-4"], tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert f"error: unknown option {flag}; did you mean {want}?" in out.stderr, out.stderr[-2000:]
    # a flag from before the config's groups names its new place, and nothing else
    for flag, want in (("--learning_rate", "--optim.lr"), ("--learning-rate", "--optim.lr"), ("--total_iterations", "--run.iterations")):
        out = _cli(["train", flag, "3"], tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1] == f"ppo-lab train: error: --{flag.lstrip('-').replace('-', '_')} is now {want}", out.stderr[-2000:]


def test_an_old_field_name_points_to_its_new_one():
    from ppo_lab.config import PPOConfig

    with pytest.raises(ValueError, match=r"^kind is now kl.estimator$"):
        PPOConfig.from_dict({"kind": "k3", "advantage.lamda": 0.9})
    with pytest.raises(ValueError, match=r"unknown advantage field\(s\): 'lamda' \(did you mean 'lam'\?\)"):
        PPOConfig.from_dict({"advantage.lamda": 0.9})


def test_a_prompts_file_of_the_wrong_shape_says_what_is_wrong_with_it(tmp_path):
    from ppo_lab.build import read_prompts

    (tmp_path / "n.jsonl").write_text('{"prompt": 5}\n')
    with pytest.raises(ValueError, match=r"n.jsonl', line 1: 'prompt' holds 5, not a non-empty string"):
        read_prompts(str(tmp_path / "n.jsonl"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match=r"prompts file '.*folder' is a folder; name a file"):
        read_prompts(str(tmp_path / "folder"))
    # a .json file holding one JSON array (of strings or of objects) is read as such
    (tmp_path / "a.json").write_text(json.dumps(["the food was", "this movie is"], indent=1))
    assert read_prompts(str(tmp_path / "a.json")) == ["the food was", "this movie is"]
    (tmp_path / "o.json").write_text(json.dumps([{"text": "the food was"}, {"text": "it was"}]))
    assert read_prompts(str(tmp_path / "o.json"), "text") == ["the food was", "it was"]
    (tmp_path / "m.json").write_text(json.dumps([{"text": "x"}, 3]))
    with pytest.raises(ValueError, match=r"m.json', item 1: a JSON number, not an object with the prompt under 'text'"):
        read_prompts(str(tmp_path / "m.json"), "text")


def test_contradictory_resume_settings_are_named(tiny_path, tmp_path):
    from ppo_lab.config import PPOConfig

    with pytest.raises(ValueError, match=r"run.overwrite starts the run in output_dir over, run.resume_from = 'latest' continues it; set one of them"):
        PPOConfig(**{"run.overwrite": True, "run.resume_from": "latest"})
    PPOTrainer(small_config(tmp_path, {"run.iterations": 3, "run.save_interval": 1})).train()
    before = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ValueError, match=r"run.iterations = 2 is below the iteration of checkpoint '.*checkpoint-000003' \(3\): there is nothing to resume"):
        PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "run.resume_from": "latest"}))
    assert (tmp_path / "run" / "config.yaml").read_text() == before


def test_a_finite_but_enormous_reward_is_named_not_reported_as_non_finite_gradients(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2, "run.max_bad_updates": 2}), reward_fn=lambda prompts, responses: [1e30] * len(responses))
    with pytest.warns(RuntimeWarning, match=r"update skipped \(1 of at most 2\): unusable reward \(reward/score_mean: reward .* returned \[1\.0\d*e\+30, .*\]; scores beyond \+-1e\+18 overflow float32 once squared .* scale the reward down"):
        with pytest.raises(NonFiniteError, match=r"max_bad_updates = 2 reached"):
            trainer.train()


# --- a collapsed policy is named, and never saved as a good one without a warning -----------
def test_collapse_signatures_are_named_and_healthy_metrics_are_not():
    from ppo_lab.metrics import ENTROPY_FLOOR, collapse_problem

    healthy = {"response/length_mean": 7.5, "reward/ended_frac": 0.4, "objective/entropy": 0.9}
    assert collapse_problem(healthy) is None
    assert collapse_problem({**healthy, "objective/entropy": 3 * ENTROPY_FLOOR}) is None  # low, not collapsed
    # one response longer than its stop token, or one that did not stop: not every response is a lone stop token
    assert collapse_problem({**healthy, "response/length_mean": 1.0625, "reward/ended_frac": 1.0}) is None
    assert collapse_problem({**healthy, "response/length_mean": 1.0, "reward/ended_frac": 0.9375}) is None
    assert "every response is a lone stop token" in collapse_problem({**healthy, "response/length_mean": 1.0, "reward/ended_frac": 1.0})
    assert "objective/entropy = 0 nats per token, below 0.001" in collapse_problem({**healthy, "objective/entropy": 0.0})


def test_a_collapse_warns_once_when_it_begins_and_again_at_every_save_until_it_ends():
    from ppo_lab.metrics import CollapseWatch

    healthy = {"response/length_mean": 7.5, "reward/ended_frac": 0.4, "objective/entropy": 0.9, "objective/kl": 0.1}
    dead = {**healthy, "objective/entropy": 0.0, "objective/kl": 41.0}
    watch, asked = CollapseWatch(), []
    newest = lambda: asked.append(1) or "run/checkpoints/checkpoint-000002"
    assert watch.observe(2, healthy, 0.3, newest) is None and watch.saving(2, "the checkpoint written") is None
    note = watch.observe(3, dead, 0.3, newest)
    assert note.startswith("iteration 3: the policy has collapsed: objective/entropy = 0 nats per token")
    assert "objective/kl = 41 nats" in note and "optim.lr = 0.3" in note
    assert note.endswith("the newest checkpoint from before the collapse is 'run/checkpoints/checkpoint-000002'")
    assert watch.observe(4, dead, 0.3, newest) is None and len(asked) == 1  # warned at the onset only
    assert watch.saving(4, "the checkpoint written") == (
        "the checkpoint written at iteration 4 holds a collapsed policy (since iteration 3: objective/entropy = 0 nats per token, "
        "below 0.001: the policy samples nearly every token with probability 1); the newest checkpoint from before the collapse "
        "is 'run/checkpoints/checkpoint-000002'"
    )
    assert watch.observe(5, healthy, 0.3, newest) is None and watch.saving(5, "x") is None  # it recovered
    assert watch.observe(6, dead, 0.3, lambda: None).endswith("no checkpoint was written before it")


def test_a_learning_rate_that_collapses_the_policy_is_named_and_its_saves_say_so(tiny_path, tmp_path):
    """A learning rate of 0.3 collapses the tiny policy within a few iterations. When it happens
    depends on the machine's floats (iteration 3 to 8 over seeds 0-4, on two instruction sets),
    and a policy may recover and collapse again, so the run goes one iteration at a time up to
    the first collapse, and what is saved then is checked."""
    import warnings

    cfg = small_config(tmp_path, {
            "optim.lr": 0.3, "run.iterations": 16, "run.save_interval": 1, "run.keep_checkpoints": 20,
            "sampling.max_new_tokens": 6,
        })
    trainer = PPOTrainer(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while trainer.iteration < cfg.run.iterations and not any("the policy has collapsed" in str(w.message) for w in caught):
            trainer.train(1)
        start = trainer.iteration
        trainer.save(tmp_path / "collapsed")
    notes = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    onsets = [n for n in notes if "the policy has collapsed" in n]
    assert len(onsets) == 1 and onsets[0].startswith(f"iteration {start}: the policy has collapsed"), notes
    last = trainer.history[-1]
    assert last["objective/entropy"] < 1e-3 or (last["response/length_mean"] <= 1 and last["reward/ended_frac"] == 1)
    before = tmp_path / "run" / "checkpoints" / f"checkpoint-{start - 1:06d}"
    assert f"the newest checkpoint from before the collapse is '{before}'" in onsets[0]
    saves = [n for n in notes if "holds a collapsed policy" in n]
    assert any(n.startswith(f"the checkpoint written at iteration {start} holds") for n in saves), notes
    assert any(n.startswith(f"the policy saved to '{tmp_path / 'collapsed'}' at iteration {start} holds") for n in saves), notes
    assert (tmp_path / "collapsed").is_dir()  # saved, and said to be collapsed


def test_an_unknown_tracker_and_a_missing_policy_folder_name_their_field(tmp_path):
    from ppo_lab.config import PPOConfig

    with pytest.raises(ValueError, match=r"run.report_to = 'tensorboard,nosuch': 'nosuch' is not a tracker accelerate knows; valid values are: all, .*tensorboard"):
        PPOConfig(**{"run.report_to": "tensorboard,nosuch"})  # was accelerate's "Unsupported logging capability", with no field
    assert PPOConfig(**{"run.report_to": "tensorboard, wandb"}).run.report_to == "tensorboard, wandb"
    with pytest.raises(ValueError, match=r"could not load the tokenizer of policy.model from '/nonexistent/model': no such folder"):
        PPOTrainer(PPOConfig(**{"policy.model": "/nonexistent/model", "run.output_dir": str(tmp_path / "run")}))


def test_a_flag_whose_name_has_no_underscore_is_registered_once():
    import argparse

    from ppo_lab.config import PPOConfig

    parser = argparse.ArgumentParser()
    PPOConfig.add_arguments(parser)
    task = next(a for a in parser._actions if a.dest == "data.task")
    assert task.option_strings == ["--data.task"]  # argparse's errors said "argument --task/--task"
    assert next(a for a in parser._actions if a.dest == "optim.max_grad_norm").option_strings == ["--optim.max_grad_norm", "--optim.max-grad-norm"]


def test_the_command_lines_own_warnings_are_one_line_each(tiny_path, tmp_path):
    _cli(["train", *SMALL, "--run.iterations", "2", "--run.save_interval", "1", "--run.output_dir", "r"], tmp_path)
    newest = tmp_path / "r" / "checkpoints" / "checkpoint-000002" / "policy.safetensors"
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF
    newest.write_bytes(bytes(data))
    out = _cli(["train", *SMALL, "--run.iterations", "3", "--run.output_dir", "r", "--run.resume_from", "latest"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ppo-lab: warning: checkpoint 'r/checkpoints/checkpoint-000002' is corrupted: the sha256 of policy.safetensors does not match the manifest; using the previous checkpoint\n" in out.stderr
    assert "UserWarning" not in out.stderr and "checkpoint.py" not in out.stderr, out.stderr[-2000:]


def test_a_misspelt_keyword_to_the_config_names_the_near_miss():
    import inspect

    from ppo_lab.config import PPOConfig

    with pytest.raises(TypeError, match=r"unknown PPOConfig setting 'learnig_rate'; the groups are policy, lora"):
        PPOConfig(learnig_rate=1e-4)  # was Python's "unexpected keyword argument", with no suggestion
    with pytest.raises(TypeError, match=r"unknown optim field\(s\): 'lrr' \(did you mean 'lr'\?\)"):
        PPOConfig(optim=dict(lrr=1e-4))
    with pytest.raises(TypeError, match=r"^kind is now kl.estimator$"):
        PPOConfig(kind="k3")
    assert "optim" in inspect.signature(PPOConfig).parameters  # the signature is still the groups'
