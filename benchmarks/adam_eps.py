"""Adam's epsilon on the tiny model: PyTorch's 1e-8 (ppo_lab's default) against the recipes' 1e-5.

    .venv/bin/python benchmarks/adam_eps.py > benchmarks/results/adam_eps.txt

Ten iterations of the default run per seed (0, 1, 2) and epsilon, with `target_kl` off so that
every minibatch steps; prints, per epsilon and seed, the mean `policy/approx_kl` and
`policy/clipfrac` of the first three iterations (where N measured its Adam gap) and the mean
`reward/score_mean` of the last three. About a minute on 2 CPU cores.
"""

import statistics
import warnings

from ppo_lab.book import train

warnings.filterwarnings("ignore")
SEEDS = (0, 1, 2)

print("adam_eps  seed  approx_kl(it 1-3)  clipfrac(it 1-3)  score(it 8-10)")
for eps in (1e-8, 1e-5):
    for seed in SEEDS:
        _, history = train({"run.iterations": 10, "run.seed": seed, "optim.adam_eps": eps, "optim.early_stop_kl": None})
        kl = statistics.mean(m["policy/approx_kl"] for m in history[:3])
        clip = statistics.mean(m["policy/clipfrac"] for m in history[:3])
        score = statistics.mean(m["reward/score_mean"] for m in history[-3:])
        print(f"{eps:8.0e}  {seed:4d}  {kl:17.4f}  {clip:16.3f}  {score:14.3f}")
