"""The course's assignments and autograder (ppo_lab.course): for every assignment the reference
package scores full marks, the untouched skeleton scores zero without crashing the grader, and
each planted bug loses exactly the marks of the property it breaks, with a message naming it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_lab.course import ASSIGNMENTS, create, grade
from ppo_lab.course.cli import main
from ppo_lab.course.grader import summary
from ppo_lab.course.handout import check_files, properties
from ppo_lab.course.regions import find_regions, names_used_later, regions_in_package, skeleton

PACKAGE = Path(__file__).resolve().parents[1] / "ppo_lab"

# (assignment, file in ppo_lab, the correct code, the bug, the one check it must fail, a phrase of its message)
PLANTED = {
    "missing temperature": ("logprobs", "logprobs.py", "zip(scaled_rows(logits, temperature), response_ids)",
                            "zip(scaled_rows(logits, 1.0), response_ids)", "test_the_temperature_divides_the_logits", "temperature was ignored"),
    "stop_after ignored": ("logprobs", "masked.py", "    if stop_after:\n", "    if False:\n",
                           "test_a_stop_token_before_stop_after_is_ordinary", "before stop_after"),
    "GAE run over padding": ("gae", "gae.py",  # the recursion as TRL and AlpacaFarm run it: through whatever padding holds
                             ["    r = torch.where(real, rewards, torch.zeros_like(rewards))\n    v = torch.where(real, values, torch.zeros_like(values)).to(r.dtype)\n",
                              "        next_adv = torch.where(real[:, t], adv_t, next_adv)\n        next_value = torch.where(real[:, t], v[:, t], next_value)\n"],
                             ["    r = rewards.clone()\n    v = values.to(r.dtype)\n", "        next_adv = adv_t\n        next_value = v[:, t]\n"],
                             "test_gae_ignores_what_padding_holds",
                             "advantages changed when only the values and rewards stored at padded positions changed"),
    "whitening with padding": ("gae", "masked.py", "mean, var = masked_mean(xc, mc), masked_var(xc, mc)", "mean, var = xc.mean(), xc.var()",
                               "test_whitening_ignores_padding", "must come from the real tokens only"),
    "score one token late": ("shaping", "shaping.py", "rewards[rows, last] += scores", "rewards[rows, last + 1] += scores",
                             "test_the_score_sits_on_the_last_real_token", "its last real token"),
    "KL penalty on padding": ("shaping", "shaping.py", "rewards = torch.where(m.bool(), -kl_coef * kl, torch.zeros_like(kl))",
                              "rewards = -kl_coef * kl", "test_padding_gets_no_reward", "padded positions should get 0"),
    "min and max swapped in the clipped loss": ("clipping", "clipping.py", "per_token = torch.maximum(unclipped, clipped)",
                                                "per_token = torch.minimum(unclipped, clipped)", "test_outside_the_range_the_pessimistic_term_wins",
                                                "the pessimistic of the two"),
    "value clipped around the return": ("clipping", "value.py", "values_clipped = old_values + torch.clamp(values - old_values, -c, c)",
                                        "values_clipped = returns + torch.clamp(values - returns, -c, c)", "test_value_loss_with_clipping",
                                        "around the OLD value"),
    "advantages not whitened": ("ppo_update", "update.py", "advantages = masked_whiten(advantages, mask)", "advantages = advantages",
                                "test_advantages_are_whitened_gae_of_the_shaped_rewards", "then whitened over the real tokens"),
    "gradients not zeroed between steps": ("ppo_update", "update.py", "            optimizer.zero_grad(set_to_none=True)\n", "",
                                           "test_each_step_uses_its_own_minibatch_alone", "zero the gradients"),
    "RLOO baseline includes the sample": ("grpo", "estimators.py", "baseline = (_group_sum(totals, index, counts)[index] - totals) / (n - 1)",
                                          "baseline = _group_sum(totals, index, counts)[index] / n", "test_rloo_leaves_one_out", "mean of the others"),
    "GRPO's std without n - 1": ("grpo", "estimators.py", "index, counts) / (n - 1))", "index, counts) / n)",
                                 "test_grpo_group_mean_and_std", "std with n - 1"),
}


def graded_tests(name):
    """{test name: points} of every check of an assignment."""
    return {p["test"]: p["points"] for f in check_files(name) for p in properties(f)}


def failed(report):
    return {t["name"]: t for t in report["tests"] if t["score"] < t["max_score"]}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The reference folder of every assignment (created once; the planted bugs copy them)."""
    root = tmp_path_factory.mktemp("references")
    return {name: create(name, root / name, solution=True) for name in ASSIGNMENTS}


@pytest.mark.parametrize("name", list(ASSIGNMENTS))
def test_the_reference_scores_full_marks(references, name):
    report = grade(references[name])
    assert report["score"] == report["extra_data"]["max_score"] == sum(graded_tests(name).values()), failed(report)
    assert len(report["tests"]) == len(graded_tests(name))
    assert set(report["extra_data"]["functions"]) == {f for _, f in ASSIGNMENTS[name].functions}
    assert {t["visibility"] for t in report["tests"]} == {"visible", "after_published"}


@pytest.mark.parametrize("name", list(ASSIGNMENTS))
def test_the_untouched_skeleton_scores_zero(tmp_path, name):
    folder = create(name, tmp_path / name)
    for module, function in ASSIGNMENTS[name].functions:
        source = (folder / Path(*module.split("."))).with_suffix(".py").read_text()
        assert f'NotImplementedError("{function}: not written yet' in source
        assert "### BEGIN SOLUTION" not in source
    report = grade(folder)
    assert report["score"] == 0 and len(report["tests"]) == len(graded_tests(name))
    for t in report["tests"]:
        assert t["output"].startswith("NotImplementedError:") and "not written yet" in t["output"], t


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_loses_exactly_its_property(references, tmp_path, bug):
    name, file, good, bad, check, phrase = PLANTED[bug]
    folder = tmp_path / "submission"
    shutil.copytree(references[name], folder)
    path = folder / "ppo_lab" / file
    source = path.read_text()
    for g, b in zip(*((good, bad) if isinstance(good, list) else ([good], [bad]))):
        assert source.count(g) == 1, f"the planted bug's anchor is not unique in {file}: {g!r}"
        source = source.replace(g, b)
    path.write_text(source)
    report = grade(folder)
    points = graded_tests(name)
    lost = failed(report)
    names = {t["name"]: test for test, t in zip([p["test"] for f in check_files(name) for p in properties(f)], report["tests"])}
    assert {names[n] for n in lost} == {check}, {n: t["output"] for n, t in lost.items()}
    assert report["score"] == sum(points.values()) - points[check]
    (message,) = [t["output"] for t in lost.values()]
    assert phrase in message, message


def test_the_grader_survives_a_syntax_error_and_an_endless_loop(references, tmp_path):
    broken = shutil.copytree(references["grpo"], tmp_path / "broken")
    path = broken / "ppo_lab" / "estimators.py"
    path.write_text(path.read_text().replace("def grpo_estimator(", "def grpo_estimator((", 1))
    report = grade(broken)
    assert report["score"] == 0 and all("SyntaxError" in t["output"] for t in report["tests"]), report["tests"][0]
    # an endless loop in grpo_estimator: the checks that finished before it keep their marks
    looping = shutil.copytree(references["grpo"], tmp_path / "looping")
    path = looping / "ppo_lab" / "estimators.py"
    path.write_text(path.read_text().replace("    n = counts.to(totals.dtype)\n", "    while True:\n        pass\n", 1))
    report = grade(looping, timeout=20)
    public_rloo = sum(p["points"] for p in properties(check_files("grpo", hidden=False)[0]) if p["function"] == "rloo_estimator")
    assert report["score"] == public_rloo == report["extra_data"]["functions"]["rloo_estimator"]["score"]
    stuck = [t for t in report["tests"] if t["tags"][0] == "grpo_estimator"]
    assert stuck and all(t["score"] == 0 and "did not finish in 20 s" in t["output"] for t in stuck), stuck
    assert "did not finish" in summary(report)


def test_an_instructors_own_checks_run_as_hidden_checks(references, tmp_path):
    extra = tmp_path / "mine"
    extra.mkdir()
    (extra / "test_my_gae.py").write_text(
        'import torch\nfrom _grading import expect, graded, lab\n\n\n@graded("compute_gae", 4)\n'
        'def test_two_tokens():\n    """two tokens, gamma = lam = 1: A_0 = r_0 + r_1 - V_0"""\n'
        '    adv, _ = lab().compute_gae(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2), 1.0, 1.0)\n'
        '    expect(abs(float(adv[0, 0]) - 2.5) < 1e-6, f"expected 2.5, got {float(adv[0, 0])}")\n')
    report = grade(references["gae"], extra_checks=extra)
    (mine,) = [t for t in report["tests"] if t["name"].startswith("compute_gae: two tokens")]
    assert mine["score"] == mine["max_score"] == 4 and mine["visibility"] == "after_published"
    assert report["score"] == report["extra_data"]["max_score"] == sum(graded_tests("gae").values()) + 4
    (extra / "test_broken.py").write_text("import torch\nfrom _grading import graded\n\n@graded('compute_gae', 1)\ndef test_x():\n    pass\n\nimport no_such_module\n")
    assert main(["grade", str(references["gae"]), "--extra-checks", str(extra)]) == 3  # the checks could not run
    report = grade(references["gae"], extra_checks=extra)
    assert report["score"] == 0 and "could not be loaded" in report["extra_data"]["problem"], report["extra_data"]["problem"]
    (extra / "test_broken.py").write_text("def oops(:\n")
    with pytest.raises(ValueError, match="test_broken.py cannot be read: SyntaxError"):
        grade(references["gae"], extra_checks=extra)


def test_public_checks_run_as_plain_pytest_in_the_students_folder(tmp_path):
    """A student runs `python -m pytest tests` in the folder: their copy of ppo_lab is tested."""
    folder = create("shaping", tmp_path / "s")
    out = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"], cwd=folder, capture_output=True, text=True)
    assert out.returncode == 1 and "NotImplementedError" in out.stdout and "3 failed" in out.stdout, out.stdout[-2000:]


def test_the_command_line(references, tmp_path, capsys):
    report = tmp_path / "out" / "results.json"
    assert main(["grade", str(references["gae"]), "--json", str(report), "--public-only"]) == 0
    data = json.loads(report.read_text())
    assert data["score"] == data["extra_data"]["max_score"] > 0 and data["extra_data"]["public_only"]
    assert all(t["visibility"] == "visible" for t in data["tests"])
    assert "assignment gae:" in capsys.readouterr().out
    skeleton_folder = create("gae", tmp_path / "student")
    assert main(["grade", str(skeleton_folder), "--fail-under", "1"]) == 1
    assert main(["create", "gae", str(skeleton_folder)]) == 2  # not empty: nothing is overwritten
    assert "not an empty folder" in capsys.readouterr().err
    assert main(["create", "nope", str(tmp_path / "x")]) == 2
    assert "the assignments are: logprobs, gae" in capsys.readouterr().err
    assert main(["grade", str(tmp_path)]) == 2
    assert main(["list"]) == 0 and "ppo_update" in capsys.readouterr().out


def test_the_handout_lists_the_specification_and_the_marks(tmp_path):
    text = (create("clipping", tmp_path / "c") / "README.md").read_text()
    assert "def clipped_policy_loss(\n    logprobs: torch.Tensor," in text and "The PPO-clip policy loss, to be minimised." in text
    assert "| `clipped_value_loss` | without value_clip the loss is half the mean squared error | 2 |" in text
    assert "(hidden checks)" in text and "Read chapter 6" in text


def test_every_assignment_has_its_regions_and_the_regions_are_well_formed():
    found = regions_in_package(PACKAGE)
    by_assignment = {}
    for regions in found.values():
        for r in regions:
            by_assignment.setdefault(r.assignment, set()).add(r.function)
    assert by_assignment == {name: {f for _, f in a.functions} for name, a in ASSIGNMENTS.items()}


def test_names_used_after_a_region_inside_a_block():
    text = ("def f(x, flag):\n    if flag:\n        ### BEGIN SOLUTION a\n        y = g(\n            mask=x,\n        )\n"
            "        z: int = 2\n        w = 'y'\n        ### END SOLUTION\n    return y + z + x.w\n")
    (region,) = find_regions(text)
    assert names_used_later(text.split("\n"), region) == ["y", "z"]  # not mask (a keyword), not w (an attribute)


def test_skeleton_replaces_a_region_and_says_what_the_rest_uses():
    text = "def f(x):\n    y = x + 1\n    ### BEGIN SOLUTION a\n    z = y * 2\n    w, v = z, 3\n    ### END SOLUTION\n    return z + w\n\n\ndef g():\n    ### BEGIN SOLUTION b\n    return 1\n    ### END SOLUTION\n"
    out = skeleton(text, "a")
    assert "    # The rest of the function uses: z, w.\n    raise NotImplementedError(\"f: not written yet (assignment 'a')\")\n    return z + w" in out
    assert "def g():\n    return 1\n" in out and "SOLUTION" not in out  # the other assignment's code is kept, its markers dropped
    (region,) = [r for r in find_regions(text) if r.assignment == "a"]
    assert names_used_later(text.split("\n"), region) == ["z", "w"]


def test_skeleton_cuts_several_assignments_at_once():
    """The student edition of the book cuts every assignment of a file, each naming its own."""
    text = "def f(x):\n    ### BEGIN SOLUTION a\n    return x\n    ### END SOLUTION\n\n\ndef g():\n    ### BEGIN SOLUTION b\n    return 1\n    ### END SOLUTION\n\n\ndef h():\n    ### BEGIN SOLUTION c\n    return 2\n    ### END SOLUTION\n"
    out = skeleton(text, ["a", "b"])
    assert "raise NotImplementedError(\"f: not written yet (assignment 'a')\")" in out
    assert "raise NotImplementedError(\"g: not written yet (assignment 'b')\")" in out
    assert "return x" not in out and "return 1" not in out
    assert "def h():\n    return 2\n" in out and "SOLUTION" not in out  # c is not cut, only unmarked
    assert skeleton(text, "a") == skeleton(text, ["a"])


@pytest.mark.parametrize("text, problem", [
    ("def f():\n    ### BEGIN SOLUTION a\n    x = 1\n", "<source>:2: '### BEGIN SOLUTION' without an END"),
    ("def f():\n    x = 1\n    ### END SOLUTION\n", "<source>:3: '### END SOLUTION' without a BEGIN"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### END SOLUTION\n", "needs the assignment's name"),
    ("### BEGIN SOLUTION a\nx = 1\n### END SOLUTION\n", "must sit inside a function"),
    ("def f():\n    ### BEGIN SOLUTION a\n    ### BEGIN SOLUTION a\n", "opens inside the one opened at line 2"),
])
def test_a_malformed_region_is_named(text, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        find_regions(text)
