"""``search --save-plans``: each plan found written as an experiment YAML that the config loader
reads back to the same experiment, and that ``suggest`` takes as targets."""

import argparse
import json
import types

import pytest

from diffcost import cli
from diffcost.cli.search import save_plans
from diffcost.config import ConfigError, load_experiment
from diffcost.space import load_space


@pytest.mark.parametrize(
    "model, cluster, gpus, batch, seq",
    [("llama3-70b", "dgx-h100", 64, 128, 4096), ("mixtral-8x7b", "dgx-h100", 32, 64, None)],
)
def test_saved_plans_read_back_to_the_plans(tmp_path, model, cluster, gpus, batch, seq):
    space = load_space(model, cluster, gpus, batch, seq)
    choices = space.choices()
    picked = choices[:: max(1, len(choices) // 9)]  # layouts, schedules, ZeRO, recompute, orders
    result = types.SimpleNamespace(best=[types.SimpleNamespace(choice=c) for c in picked])
    args = argparse.Namespace(save_plans=str(tmp_path / "plans"), model=model, cluster=cluster,
                              seq=seq)  # fmt: skip
    paths = save_plans(args, space, result)
    names = [f"plan-{k}.yaml" for k in range(1, len(picked) + 1)]
    assert [p.rsplit("/", 1)[1] for p in paths] == names
    for path, c in zip(paths, picked):
        exp = load_experiment(path)
        assert exp.plan == space.plan_spec(c)
        assert exp.model == space.model and exp.cluster == space.cluster
        assert exp.plan.n_gpus == gpus


def test_saved_plans_are_targets_of_suggest(tmp_path, capsys):
    space = load_space("gpt3-175b", "selene-a100-80g", 64, 64)
    c1, c2 = [c for c in space.choices() if c.tp == 8 and c.pp == 8 and c.cp == 1][:2]
    result = types.SimpleNamespace(best=[types.SimpleNamespace(choice=c) for c in (c1, c2)])
    args = argparse.Namespace(save_plans=str(tmp_path), model="gpt3-175b", cluster="selene-a100-80g",
                              seq=None)  # fmt: skip
    first, second = save_plans(args, space, result)
    argv = ["suggest", first, second, "--budget", "1", "--runs-only", "--json"]
    assert cli.main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert [t["config"] for t in d["targets"]] == [first, second]
    assert len(d["suggestions"]) == 1


def test_a_folder_that_cannot_be_made_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    space = load_space("llama3-70b", "dgx-h100", 64, 128)
    result = types.SimpleNamespace(best=[types.SimpleNamespace(choice=space.choices()[0])])
    args = argparse.Namespace(save_plans=str(blocker / "sub"), model="llama3-70b",
                              cluster="dgx-h100", seq=None)  # fmt: skip
    with pytest.raises(ConfigError, match="--save-plans .*file/sub: cannot create the folder"):
        save_plans(args, space, result)
