"""Run by tests/test_sharding.py under `accelerate launch`: a sharded policy samples inside
`FSDP2Sharding.gathered`, one process's rows all stopping at the first token; the collectives
issued inside `generate` are counted (JSON to argv[1])."""

import datetime
import json
import sys

import torch
import torch.distributed as dist

from ppo_lab.models import load_tokenizer
from ppo_lab.sampling import Sampling, generate
from ppo_lab.sharding import FSDP2Sharding
from ppo_lab.tiny import tiny_model_path

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier", "send", "recv", "scatter", "gather", "reduce")


def main(out: str) -> None:
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    PartialState(timeout=datetime.timedelta(seconds=30))  # a hang fails in 30 s, not in 30 minutes
    torch.set_num_threads(1)
    rank = dist.get_rank()
    sharding = FSDP2Sharding(torch.device("cpu"), "fp32")
    model = sharding.shard(AutoModelForCausalLM.from_pretrained(tiny_model_path()).eval())
    tokenizer = load_tokenizer(tiny_model_path())
    tokenizer.padding_side = "left"
    calls = []
    c10d = dist.distributed_c10d
    for name in dir(c10d):  # every collective of torch.distributed, however FSDP2 calls it
        fn = getattr(c10d, name)
        if callable(fn) and not name.startswith("_") and any(name.startswith(c) for c in COLLECTIVES):
            def spy(*a, _fn=fn, _name=name, **k):
                calls.append(_name)
                return _fn(*a, **k)
            setattr(c10d, name, spy)
            if hasattr(dist, name):
                setattr(dist, name, spy)
    counted = {"inside": 0}

    # rank 1: every token is a stop token, so its rows stop at the first one; rank 0's run on
    stops = tuple(range(len(tokenizer))) if rank == 1 else (tokenizer.eos_token_id,)
    settings = Sampling(max_new_tokens=16, stop_ids=stops, ignore_eos=False)
    uniforms = torch.rand(4, 16, generator=torch.Generator().manual_seed(rank))
    with sharding.gathered(model):
        before = len(calls)
        sample = generate(model, tokenizer, ["the movie was", "i think", "2 + 3 =", "the"], settings, uniforms=uniforms)
        counted["inside"] = len(calls) - before
    seen_outside = len(calls)
    with torch.no_grad():  # outside, a sharded forward is a collective (so the spy sees them)
        model(input_ids=torch.tensor([[3, 4, 5]]))
    result = {"rank": rank, "steps": sample.response_ids.shape[1], "inside": counted["inside"], "forward_outside": len(calls) - seen_outside}
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(gathered, fh)


if __name__ == "__main__":
    main(sys.argv[1])
