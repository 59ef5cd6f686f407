"""How a round's clients are grouped for training: alone, or several of one shape at once, spread
so that every actor of a pool gets work."""

from hfl.backends.base import ClientEnvironment
from hfl.server import initial_state, sample_cohort, train_settings
from hfl.types import RoundContext
from tests.conftest import small_config


def round_tasks(config, round_=1):
    env = ClientEnvironment.from_config(config)
    state = initial_state(config, env)
    settings = train_settings(config.fl, round_)
    tasks = [env.method.plan(RoundContext(round_, c, config.seed, len(env.partitions[c]), settings, env.budgets[c]), state.method_state)
             for c in sample_cohort(config, round_)]
    return env, tasks


def test_units_group_clients_of_one_shape_and_size_and_spread_over_the_actors():
    env, tasks = round_tasks(small_config(data={"partition": "iid"}, fl={"clients": 8, "fraction": 1.0}))
    sizes = {t.ctx.num_samples for t in tasks}
    assert env.work_units(tasks, batch_clients=1, spread=2) == [[i] for i in range(8)]
    for spread in (1, 2, 3):
        units = env.work_units(tasks, batch_clients=8, spread=spread)
        assert sorted(i for u in units for i in u) == list(range(8))  # every task once
        assert all(len({tasks[i].ctx.num_samples for i in u}) == 1 for u in units)  # one sample count per unit
        assert len(units) >= min(spread, 8) and len(units) <= spread * len(sizes)
    assert max(len(u) for u in env.work_units(tasks, batch_clients=2, spread=1)) == 2


def test_a_task_that_cannot_train_beside_others_is_a_unit_of_its_own():
    # FjORD's objective draws a width per step (not marked vectorisable): its clients train one by one.
    env, tasks = round_tasks(small_config(method={"name": "fjord"}, model={"name": "preresnet20"}, fl={"clients": 6, "fraction": 1.0}))
    assert env.work_units(tasks, batch_clients=4, spread=2) == [[i] for i in range(6)]
