import pytest

from hpcdl.launch import LaunchError, RankEnv, expand_nodelist, slurm_group_plan


def slurm_env(**extra):
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_NNODES": "2", "SLURMD_NODENAME": "n2", "SLURM_ARRAY_TASK_ID": "7"}
    env.update(extra)
    return env


def test_rank_from_slurm():
    r = RankEnv.from_slurm(slurm_env())
    assert r == RankEnv(rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2,
                        hostname="n2", group=7)


def test_horovod_env_round_trip():
    r = RankEnv.from_slurm(slurm_env())
    env = r.to_horovod_env("10.0.0.1", 4567, iface="ib0")
    assert env["HOROVOD_RANK"] == "3" and env["HOROVOD_SIZE"] == "4"
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1" and env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4567"
    assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_GLOO_IFACE"] == "ib0"
    assert RankEnv.from_horovod(env) == r


def test_missing_slurm_variable_says_how_to_fix():
    env = slurm_env()
    del env["SLURM_PROCID"]
    with pytest.raises(LaunchError, match="SLURM_PROCID is not set.*HINT"):
        RankEnv.from_slurm(env)


def test_uneven_tasks_per_node_rejected():
    with pytest.raises(LaunchError, match="ntasks-per-node"):
        RankEnv.from_slurm(slurm_env(SLURM_NTASKS="3"))


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]),
    ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
    ("c[01-03],gpu1", ["c01", "c02", "c03", "gpu1"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("nid[00098-00101]", ["nid00098", "nid00099", "nid00100", "nid00101"]),
])
def test_expand_nodelist(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("bad", ["n[1-3", "n1]", "n[3-1]", "n[a-b]"])
def test_bad_nodelist(bad):
    with pytest.raises(LaunchError):
        expand_nodelist(bad)


def test_slurm_group_plan_matches_block_distribution():
    plan = slurm_group_plan(["a", "b"], ranks_per_node=2, group=1)
    assert [(p.rank, p.hostname, p.local_rank, p.cross_rank) for p in plan] == [
        (0, "a", 0, 0), (1, "a", 1, 0), (2, "b", 0, 1), (3, "b", 1, 1)]
    assert all(p.size == 4 and p.local_size == 2 and p.cross_size == 2 and p.group == 1 for p in plan)
