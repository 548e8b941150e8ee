"""The built-in tiny model is shipped as package data; the code that trains it still works."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_lab import tiny
from ppo_lab.models import resolve_model_path


@pytest.fixture(scope="module")
def shipped():
    path = tiny.tiny_model_path()
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_builtin_name_resolves_to_the_shipped_folder():
    assert resolve_model_path("builtin:tiny") == str(tiny.SHIPPED)
    assert (tiny.SHIPPED / "model.safetensors").stat().st_size > 100_000


def test_shipped_tokenizer_matches_the_tasks_vocabulary(shipped):
    """A task whose words change needs a rebuild: this fails until `python -m ppo_lab.tiny build` runs."""
    _, tok = shipped
    fresh = tiny.build_tokenizer()
    assert tok.get_vocab() == fresh.get_vocab()
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == (tiny.PAD, tiny.EOS, tiny.UNK)
    assert tok.pad_token_id != tok.eos_token_id


def test_shipped_model_has_the_quality_its_build_recorded(shipped):
    model, tok = shipped
    info = json.loads((tiny.SHIPPED / "build.json").read_text())
    loss = tiny.held_out_loss(model, tok)
    assert loss == pytest.approx(info["held_out_loss"], abs=2e-3)
    assert loss < 1.5  # a uniform guess over the vocabulary is log(V) ~ 5 nats per token
    assert model.config.n_layer == info["spec"]["n_layer"] and model.config.n_embd == info["spec"]["n_embd"]


def test_a_rebuild_reaches_the_shipped_quality(shipped, tmp_path):
    """The bytes differ between CPUs; the quality must not (the full build, ~40 s on one thread)."""
    model, tok = shipped
    folder = tiny.build(tmp_path / "tiny", verbose=False)
    rebuilt = AutoModelForCausalLM.from_pretrained(folder)
    target = tiny.held_out_loss(model, tok)
    got = tiny.held_out_loss(rebuilt, AutoTokenizer.from_pretrained(folder))
    assert got <= target + 0.02, f"rebuilt model held-out loss {got:.4f} vs shipped {target:.4f}"
    assert json.loads((folder / "build.json").read_text())["held_out_loss"] == pytest.approx(got, abs=1e-3)


def test_a_missing_shipped_model_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "SHIPPED", tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="tiny model is missing.*python -m ppo_lab.tiny build"):
        tiny.tiny_model_path()


def test_an_interrupted_build_keeps_the_previous_model(tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"previous")

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "pretrain", boom)
    with pytest.raises(KeyboardInterrupt):
        tiny.build(folder, verbose=False)
    assert (folder / "model.safetensors").read_bytes() == b"previous"


def test_tiny_pretraining_is_deterministic():
    """Two builds with the same settings give bit-identical weights (a small spec, for speed)."""
    from ppo_lab.tiny import TinySpec, pretrain

    spec = TinySpec(n_sentiment=300, n_arithmetic=100, steps=15, batch_size=16)
    torch.set_num_threads(1)
    a, _ = pretrain(spec)
    b, _ = pretrain(spec)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c, _ = pretrain(TinySpec(n_sentiment=300, n_arithmetic=100, steps=15, batch_size=16, seed=1))
    assert any(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))
