"""Role makers: environment parsing (Paddle and torchrun names), consistency, user-defined roles."""
import pytest

from fleetx.env import EnvError
from fleetx.role_maker import PaddleCloudRoleMaker, Role, UserDefinedRoleMaker


def collective(env):
    rm = PaddleCloudRoleMaker(is_collective=True, environ=env)
    rm._ensure()
    return rm


def ps(env):
    rm = PaddleCloudRoleMaker(is_collective=False, environ=env)
    rm._ensure()
    return rm


def test_no_launcher_is_a_one_process_job():
    rm = collective({})
    assert rm._is_non_distributed()
    assert (rm._worker_index(), rm._worker_num(), rm._is_first_worker()) == (0, 1, True)
    assert rm._get_trainer_endpoints() == ["127.0.0.1:6170"]


def test_paddle_variables():
    rm = collective({"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINER_ENDPOINTS":
                     "10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170,10.0.0.2:6171",
                     "PADDLE_RANK_IN_NODE": "1"})
    assert (rm._worker_index(), rm._worker_num(), rm._node_num()) == (1, 4, 2)
    assert rm._get_local_rank() == 1 and rm._is_worker() and not rm._is_first_worker()


def test_torchrun_variables_alone():
    rm = collective({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (rm._worker_index(), rm._worker_num(), rm._get_local_rank()) == (2, 4, 0)
    assert rm._get_local_world_size() == 2
    assert not rm._is_non_distributed()


def test_both_sets_agree():
    rm = collective({"RANK": "1", "WORLD_SIZE": "2", "PADDLE_TRAINER_ID": "1",
                     "PADDLE_TRAINER_ENDPOINTS": "a:1,a:2", "LOCAL_RANK": "1",
                     "PADDLE_RANK_IN_NODE": "1"})
    assert rm._worker_index() == 1


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "2", "PADDLE_TRAINER_ID": "1", "PADDLE_TRAINER_ENDPOINTS": "a:1,a:2"},
     "PADDLE_TRAINER_ID=1 disagrees with RANK=0"),
    ({"RANK": "0", "WORLD_SIZE": "3", "PADDLE_TRAINER_ENDPOINTS": "a:1,a:2"},
     "WORLD_SIZE=3 disagrees with PADDLE_TRAINER_ENDPOINTS, which lists 2 endpoints"),
    ({"WORLD_SIZE": "2"}, "neither PADDLE_TRAINER_ID nor RANK"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "environment variable RANK='x' is not an integer"),
    ({"RANK": "5", "WORLD_SIZE": "2"}, "rank 5 (RANK / PADDLE_TRAINER_ID) is outside [0, 2)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "PADDLE_RANK_IN_NODE": "1"},
     "PADDLE_RANK_IN_NODE=1 disagrees with LOCAL_RANK=0"),
    ({"PADDLE_TRAINING_ROLE": "PSERVER"}, "PADDLE_TRAINING_ROLE='PSERVER'"),
    ({"RANK": "1"}, "RANK=1 is set but the world size is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "PADDLE_TRAINER_ENDPOINTS": "a:1"},
     "WORLD_SIZE=2 disagrees with PADDLE_TRAINER_ENDPOINTS, which lists 1 endpoint"),
    ({"PADDLE_TRAINER_ENDPOINTS": "a:1,a:2"},
     "the world size is 2 but neither PADDLE_TRAINER_ID nor RANK says which rank"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=2 is outside [0, 2) given by LOCAL_WORLD_SIZE"),
])
def test_inconsistent_collective_environment(env, message):
    with pytest.raises(EnvError) as err:
        collective(env)
    assert message in str(err.value)


PS_BASE = {"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6000,127.0.0.1:6001",
           "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:6002,127.0.0.1:6003",
           "PADDLE_TRAINERS_NUM": "2"}


def test_ps_worker_and_server():
    w = ps(dict(PS_BASE, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID="1"))
    assert w._is_worker() and w._worker_index() == 1 and w._server_num() == 2
    s = ps(dict(PS_BASE, TRAINING_ROLE="PSERVER", POD_IP="127.0.0.1", PADDLE_PORT="6001"))
    assert s._is_server() and s._server_index() == 1 and s._worker_num() == 2


def test_ps_without_servers_is_local():
    rm = ps({})
    assert rm._is_non_distributed() and rm._is_worker() and rm._server_num() == 0


@pytest.mark.parametrize("extra, message", [
    ({"PADDLE_TRAINERS_NUM": ""}, "Can not find PADDLE_TRAINERS_NUM"),
    ({}, "Can not find TRAINING_ROLE"),
    ({"TRAINING_ROLE": "BOSS"}, "TRAINING_ROLE must be PSERVER or TRAINER or HETER_TRAINER, "
                                "but got 'BOSS'"),
    ({"TRAINING_ROLE": "HETER_TRAINER"}, "Can not find PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST"),
    ({"TRAINING_ROLE": "HETER_TRAINER", "PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST": "h:1",
      "POD_IP": "h", "PADDLE_PORT": "2"},
     "this heter worker's endpoint h:2 (POD_IP:PADDLE_PORT) is not in "
     "PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST=h:1"),
    ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0",
      "PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST": "h:1", "PADDLE_HETER_TRAINER_IP_PORT_LIST": "h:2"},
     "PADDLE_HETER_TRAINER_IP_PORT_LIST=h:2 disagrees with "
     "PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST=h:1"),
    ({"TRAINING_ROLE": "TRAINER"}, "Can not find PADDLE_TRAINER_ID"),
    ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "2"},
     "PADDLE_TRAINER_ID=2 is outside [0, 2)"),
    ({"TRAINING_ROLE": "PSERVER", "PADDLE_PORT": "6000"}, "Can not find POD_IP"),
    ({"TRAINING_ROLE": "PSERVER", "POD_IP": "127.0.0.1"}, "Can not find PADDLE_PORT"),
    ({"TRAINING_ROLE": "PSERVER", "POD_IP": "127.0.0.1", "PADDLE_PORT": "7000"},
     "this server's endpoint 127.0.0.1:7000 (POD_IP:PADDLE_PORT) is not in"),
])
def test_ps_environment_errors(extra, message):
    with pytest.raises(EnvError) as err:
        ps(dict(PS_BASE, **extra))
    assert message in str(err.value)


def test_user_defined_ps_roles():
    servers = ["127.0.0.1:36011", "127.0.0.1:36012"]
    w = UserDefinedRoleMaker(current_id=1, role=Role.WORKER, worker_num=3, server_endpoints=servers)
    assert w._is_worker() and w._worker_num() == 3 and w._worker_index() == 1
    s = UserDefinedRoleMaker(current_id=1, role=Role.SERVER, worker_num=3, server_endpoints=servers)
    assert s._is_server() and s._server_index() == 1


def test_user_defined_collective_is_a_worker():
    rm = UserDefinedRoleMaker(is_collective=True, current_id=0,
                              worker_endpoints=["127.0.0.1:1", "127.0.0.1:2"])
    assert rm._is_worker() and rm._worker_num() == 2  # Paddle reports False here


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(is_collective=1), ValueError, "`is_collective` should be instance of `bool`, but got int"),
    (dict(current_id=-1, server_endpoints=["a:1"], worker_num=1), ValueError,
     "current_id must be an int >= 0"),
    (dict(role=7, server_endpoints=["a:1"], worker_num=1), ValueError,
     "role must be Role.WORKER or Role.SERVER, got None"),
    (dict(role=Role.ALL, server_endpoints=["a:1"], worker_num=1), ValueError,
     "role must be Role.WORKER or Role.SERVER"),
    (dict(server_endpoints="a:1,b:2", worker_num=1), ValueError,
     "server_endpoints must be a list of 'ip:port' strings, got 'a:1,b:2'"),
    (dict(server_endpoints=["a:1"], worker_num="2"), ValueError,
     "worker_num must be an int >= 0, got '2'"),
    (dict(bogus=1), TypeError, "unknown arguments ['bogus']"),
])
def test_user_defined_bad_arguments(kwargs, exc, message):
    with pytest.raises(exc) as err:
        UserDefinedRoleMaker(**kwargs)._ensure()
    assert message in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(worker_num=1), "needs server_endpoints"),
    (dict(server_endpoints=["a:1"]), "needs worker_num > 0"),
    (dict(is_collective=True), "needs worker_endpoints"),
    (dict(current_id=3, worker_num=2, server_endpoints=["a:1"]), "current_id=3 is outside [0, 2)"),
])
def test_user_defined_incomplete(kwargs, message):
    with pytest.raises(ValueError) as err:
        UserDefinedRoleMaker(**kwargs)._ensure()
    assert message in str(err.value)


def test_paddle_trainers_num_alone_gives_the_world():
    rm = collective({"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2"})
    assert (rm._worker_index(), rm._worker_num()) == (1, 2)


def test_cloud_role_maker_rejects_unknown_arguments():
    with pytest.raises(TypeError, match=r"unknown arguments \['is_colective'\]"):
        PaddleCloudRoleMaker(is_colective=True)


def test_user_defined_collective_worker_num_must_agree():
    with pytest.raises(ValueError, match="worker_num=3 disagrees with worker_endpoints"):
        UserDefinedRoleMaker(is_collective=True, worker_num=3,
                             worker_endpoints=["a:1", "a:2"])._ensure()


def test_user_defined_local_rank_comes_from_shared_hosts():
    eps = ["10.0.0.1:1", "10.0.0.1:2", "10.0.0.2:1", "10.0.0.2:2", "10.0.0.2:3"]
    places = []
    for i in range(len(eps)):
        rm = UserDefinedRoleMaker(is_collective=True, current_id=i, worker_endpoints=eps)
        places.append((rm._get_local_rank(), rm._get_local_world_size()))
    assert places == [(0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]


@pytest.mark.parametrize("env", [
    {"RANK": "1", "WORLD_SIZE": "2"},
    {"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:1,127.0.0.1:2"},
])
def test_plain_init_under_a_collective_launcher_joins_the_collective_job(env):
    rm = ps(env)  # fleet.init() without is_collective=True, no parameter servers
    assert rm.is_collective and not rm._is_non_distributed()
    assert (rm._worker_index(), rm._worker_num(), rm._is_worker()) == (1, 2, True)


def test_plain_init_without_a_launcher_stays_a_local_job():
    rm = ps({"PADDLE_TRAINERS_NUM": "2"})  # not a variable only a collective launcher writes
    assert not rm.is_collective and rm._is_non_distributed() and rm._worker_num() == 1


@pytest.mark.parametrize("role", ["PSERVER", "TRAINER"])
def test_collective_init_in_a_ps_launch_names_the_launch(role):
    env = dict(PS_BASE, TRAINING_ROLE=role, POD_IP="127.0.0.1", PADDLE_PORT="6000")
    with pytest.raises(EnvError) as err:
        collective(env)
    message = str(err.value)
    assert f"fleet.init(is_collective=True) in a process of a parameter-server launch " \
           f"(TRAINING_ROLE={role}, PADDLE_PSERVERS_IP_PORT_LIST=127.0.0.1:6000,127.0.0.1:6001)" \
        in message
    assert "fleetrun --nproc_per_node N script.py" in message and "PADDLE_TRAINER_ID" not in message


def test_one_endpoint_without_a_rank_is_rank_zero():
    rm = collective({"PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:6170"})  # Paddle's default id "0"
    assert (rm._worker_index(), rm._worker_num(), rm._is_first_worker()) == (0, 1, True)
    assert not rm._is_non_distributed()


@pytest.mark.parametrize("trainers_num", ["3", "1", "7"])
def test_paddle_trainers_num_is_not_checked_against_the_endpoints(trainers_num):
    # Paddle's collective role maker never reads PADDLE_TRAINERS_NUM.
    rm = collective({"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": trainers_num,
                     "PADDLE_TRAINER_ENDPOINTS": "a:1,a:2"})
    assert (rm._worker_index(), rm._worker_num()) == (1, 2)
    rm = collective({"RANK": "0", "WORLD_SIZE": "2", "PADDLE_TRAINERS_NUM": trainers_num})
    assert rm._worker_num() == 2


HETER = {"PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST": "127.0.0.1:6004,127.0.0.1:6005"}


def test_heter_worker_role_from_the_reference_environment():
    h = ps(dict(PS_BASE, **HETER, TRAINING_ROLE="HETER_TRAINER", POD_IP="127.0.0.1",
                PADDLE_PORT="6005"))
    assert h._is_heter_worker() and not h._is_worker() and not h._is_server()
    assert h._heter_worker_num() == 2 and h._heter_worker_index() == 1
    assert h._role_id() == 3  # Paddle: trainers + index
    assert h._get_heter_worker_endpoints() == ["127.0.0.1:6004", "127.0.0.1:6005"]
    w = ps(dict(PS_BASE, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID="0",
                PADDLE_HETER_TRAINER_IP_PORT_LIST="127.0.0.1:6004"))  # Paddle 2.0's name
    assert w._heter_worker_num() == 1 and not w._is_heter_worker()
    with pytest.raises(ValueError, match="not a heter worker"):
        w._heter_worker_index()


def test_heter_queries_and_paddle_to_string():
    w = ps(dict(PS_BASE, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID="1"))
    s = ps(dict(PS_BASE, TRAINING_ROLE="PSERVER", POD_IP="127.0.0.1", PADDLE_PORT="6001"))
    c = collective({"RANK": "0", "WORLD_SIZE": "2", "PADDLE_TRAINER_ENDPOINTS": "a:1,a:2"})
    for rm in (w, s, c, ps({})):
        assert rm._heter_worker_num() == 0 and rm._is_heter_worker() is False
    # Paddle's Role is a plain int class, so its to_string prints the number.
    assert s.to_string() == ("role: 2, current_id: 1, worker_endpoints: ['127.0.0.1:6002', "
                             "'127.0.0.1:6003'], server_endpoints: ['127.0.0.1:6000', "
                             "'127.0.0.1:6001']")
    assert w.to_string().startswith("role: 1, current_id: 1, ")
    assert c.to_string() == ("role: 1, current_id: 0, worker_endpoints: ['a:1', 'a:2'], "
                             "server_endpoints: []")


def test_device_ids_are_read_as_written():
    rm = collective({"RANK": "1", "WORLD_SIZE": "2", "PADDLE_LOCAL_DEVICE_IDS": "1",
                     "PADDLE_WORLD_DEVICE_IDS": "0,1"})
    assert (rm._get_local_device_ids(), rm._get_world_device_ids()) == ("1", "0,1")
    assert collective({})._get_local_device_ids() is None
