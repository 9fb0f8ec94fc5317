"""Slurm and MPI launches: host-list expansion, every variable combination, precedence, errors."""
import pytest

from fleetx import clusters
from fleetx.env import EnvError
from fleetx.role_maker import PaddleCloudRoleMaker

SRUN = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "4711"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
         "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "7000"}


def role(env, is_collective=True):
    rm = PaddleCloudRoleMaker(is_collective=is_collective, environ=env)
    rm._ensure()
    return rm


def summary(rm):
    return (rm._worker_index(), rm._worker_num(), rm._get_local_rank(),
            rm._get_local_world_size(), rm._get_master())


# -- host lists ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, hosts", [
    ("localhost", ["localhost"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("a,b[3],c", ["a", "b3", "c"]),
    ("gpu-[1,3]x.cluster", ["gpu-1x.cluster", "gpu-3x.cluster"]),
])
def test_expand_hostlist(text, hosts):
    assert clusters.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, message", [
    ("node[01-03", "host list 'node[01-03': unbalanced brackets"),
    ("node]1[", "host list 'node]1[': unbalanced brackets"),
    ("node[[1]]", "unbalanced brackets"),
    ("node[3-1]", "host list 'node[3-1]': range 3-1 runs backwards"),
    ("node[a-b]", "[a-b] holds 'a-b', expected a number or a range such as 01-03"),
    (" , ", "host list ' , ' names no host"),
])
def test_expand_hostlist_errors(text, message):
    with pytest.raises(EnvError, match=None) as info:
        clusters.expand_hostlist(text)
    assert message in str(info.value)


def test_expand_tasks_per_node():
    assert clusters.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert clusters.expand_tasks_per_node("4") == [4]
    with pytest.raises(EnvError, match=r"'2x3' is neither N nor N\(xK\)"):
        clusters.expand_tasks_per_node("2x3")


# -- Slurm ------------------------------------------------------------------------------------
def test_srun_alone_needs_no_other_variable():
    rm = role(SRUN)
    assert summary(rm) == (3, 4, 1, 2, ("node01", 20000 + 4711))
    assert rm._is_worker() and not rm._is_non_distributed()
    assert rm._get_trainer_endpoints() == []  # gathered at the rendezvous


def test_srun_port_and_address_overrides():
    env = dict(SRUN, MASTER_PORT="29500", MASTER_ADDR="login1")
    assert role(env)._get_master() == ("login1", 29500)
    env = {k: v for k, v in SRUN.items() if k != "SLURM_JOB_ID"}
    assert role(env)._get_master() == ("node01", clusters.DEFAULT_MASTER_PORT)


def test_srun_step_nodelist_and_local_sizes():
    env = dict(SRUN, SLURM_STEP_NODELIST="gpu[7-8]", SLURM_STEP_TASKS_PER_NODE="3,1",
               SLURM_NODEID="0")
    assert summary(role(env))[3:] == (3, ("gpu7", 24711))
    env = dict(SRUN, SLURM_NTASKS_PER_NODE="2", SLURM_TASKS_PER_NODE="garbage")
    assert role(env)._get_local_world_size() == 2
    env = {k: v for k, v in SRUN.items() if k != "SLURM_TASKS_PER_NODE"}
    assert role(env)._get_local_world_size() == 1  # unknown: 1, as under torchrun
    assert role(dict(env, LOCAL_WORLD_SIZE="2"))._get_local_world_size() == 2
    with pytest.raises(EnvError, match=r"SLURM_LOCALID=1 is outside \[0, 1\) given by "
                                       r"LOCAL_WORLD_SIZE"):
        role(dict(env, LOCAL_WORLD_SIZE="1"))


def test_srun_step_tasks_per_node_win_over_the_jobs_ntasks_per_node():
    # `srun -n2` inside `sbatch --ntasks-per-node=4`: the step inherits the job's 4
    env = dict(SRUN, SLURM_NTASKS_PER_NODE="4", SLURM_STEP_TASKS_PER_NODE="2,2")
    assert role(env)._get_local_world_size() == 2


def test_srun_with_pmi2_is_read_as_slurm_and_needs_no_master_addr():
    # srun --mpi=pmi2 (or MpiDefault=pmi2) sets PMI_RANK / PMI_SIZE equal to Slurm's own
    env = dict(SRUN, PMI_RANK="3", PMI_SIZE="4")
    assert clusters.detect(env).launcher == "Slurm"
    assert summary(role(env)) == (3, 4, 1, 2, ("node01", 20000 + 4711))
    # Hydra's mpirun inside an allocation numbers its own ranks: MPICH's reader takes them
    assert clusters.detect(dict(MPICH, **SRUN)).launcher == "MPICH"


def test_a_heterogeneous_slurm_job_is_refused_naming_the_variable():
    with pytest.raises(EnvError, match="SLURM_HET_SIZE=2: this is a heterogeneous Slurm job"):
        role(dict(SRUN, SLURM_HET_SIZE="2"))


def test_srun_one_task_needs_no_node_list():
    rm = role({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert summary(rm) == (0, 1, 0, 1, None)


def test_srun_agreeing_torchrun_names_are_accepted():
    rm = role(dict(SRUN, RANK="3", LOCAL_RANK="1", PADDLE_TRAINER_ID="3"))
    assert summary(rm)[:3] == (3, 4, 1)


@pytest.mark.parametrize("extra, message", [
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is outside [0, 4) given by SLURM_NTASKS=4"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID=-1 is outside [0, 4)"),
    ({"SLURM_NTASKS": "0", "SLURM_PROCID": "0"}, "SLURM_NTASKS=0 must be >= 1"),
    ({"SLURM_PROCID": "x"}, "environment variable SLURM_PROCID='x' is not an integer"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is outside [0, 2) given by the tasks per node"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is outside the 2 nodes of SLURM_TASKS_PER_NODE=2(x2)"),
    ({"SLURM_NODELIST": "node[02-01]"}, "range 02-01 runs backwards"),
    ({"SLURM_NODELIST": ""}, "neither SLURM_NODELIST (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) "
                             "nor MASTER_ADDR says where task 0 runs"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port (1-65535)"),
    ({"RANK": "2"}, "RANK=2 disagrees with SLURM_PROCID=3 (Slurm started this process)"),
    ({"PADDLE_TRAINER_ID": "0"}, "PADDLE_TRAINER_ID=0 disagrees with SLURM_PROCID=3"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0 disagrees with SLURM_LOCALID=1"),
    ({"PADDLE_RANK_IN_NODE": "0"}, "PADDLE_RANK_IN_NODE=0 disagrees with SLURM_LOCALID=1"),
    # The same world told by torchrun's names, without an elastic agent between: must agree.
    ({"RANK": "0", "WORLD_SIZE": "4"}, "RANK=0 disagrees with SLURM_PROCID=3"),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0"},
     "LOCAL_RANK=0 disagrees with SLURM_LOCALID=1"),
])
def test_srun_errors(extra, message):
    with pytest.raises(EnvError) as info:
        role(dict(SRUN, **extra))
    assert message in str(info.value)


# -- precedence ---------------------------------------------------------------------------------
def test_nested_launcher_under_srun_wins():
    # `srun --ntasks-per-node 1 fleetrun --nproc_per_node 4 ...`: the tasks are launchers, one
    # per node; their processes inherit SLURM_* for the launcher and get their own world.
    torchrun = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    slurm = dict(SRUN, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0",
                 SLURM_TASKS_PER_NODE="1(x2)")
    assert summary(role(dict(slurm, **torchrun))) == (6, 8, 2, 4, None)
    # Same size, but an elastic agent numbered the ranks: its numbering counts.
    same = dict(torchrun, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                TORCHELASTIC_RESTART_COUNT="0")
    assert summary(role(dict(slurm, **same)))[:3] == (0, 2, 0)


def test_fleetrun_paddle_names_win_over_mpi_without_master():
    # mpirun started one fleetrun per node; no MASTER_ADDR is needed, fleetrun's names decide.
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "PADDLE_TRAINER_ID": "3", "PADDLE_TRAINER_ENDPOINTS": "a:1,a:2,b:1,b:2"}
    assert role(env)._worker_index() == 3


def test_mpi_before_slurm():
    # mpirun inside an sbatch allocation: the batch step's SLURM_PROCID=0 describes the allocation.
    env = dict(OMPI, SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_NODELIST="node1")
    rm = role(env)
    assert summary(rm) == (1, 2, 1, 2, ("10.0.0.1", clusters.DEFAULT_MASTER_PORT))
    assert clusters.detect(env).launcher == "Open MPI"
    assert clusters.detect(dict(MPICH, **SRUN)).launcher == "MPICH"
    assert clusters.detect(dict(OMPI, **MPICH)).launcher == "Open MPI"


# -- MPI ----------------------------------------------------------------------------------------
def test_open_mpi():
    assert summary(role(OMPI)) == (1, 2, 1, 2, ("10.0.0.1", clusters.DEFAULT_MASTER_PORT))


def test_mpich():
    assert summary(role(MPICH)) == (1, 3, 0, 1, ("10.0.0.1", 7000))


def test_mpi_one_process_needs_no_master():
    assert summary(role({"PMI_RANK": "0", "PMI_SIZE": "1"})) == (0, 1, 0, 1, None)


@pytest.mark.parametrize("env, message", [
    ({**OMPI, "MASTER_ADDR": ""}, "Open MPI's mpirun started this process in a job of several, "
                                  "but MASTER_ADDR is not set"),
    ({**OMPI, "MASTER_ADDR": ""}, "mpirun -x MASTER_ADDR=$(hostname)"),
    ({**MPICH, "MASTER_ADDR": ""}, "mpirun -genv MASTER_ADDR $(hostname)"),
    ({**OMPI, "OMPI_COMM_WORLD_RANK": "2"},
     "OMPI_COMM_WORLD_RANK=2 is outside [0, 2) given by OMPI_COMM_WORLD_SIZE=2"),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
     "OMPI_COMM_WORLD_LOCAL_RANK=2 is outside [0, 2) given by OMPI_COMM_WORLD_LOCAL_SIZE=2"),
    ({**MPICH, "MPI_LOCALRANKID": "1"},
     "MPI_LOCALRANKID=1 is outside [0, 1) given by MPI_LOCALNRANKS=1"),
    ({**MPICH, "PMI_SIZE": "0", "PMI_RANK": "0"}, "PMI_SIZE=0 must be >= 1"),
    ({**OMPI, "RANK": "0"}, "RANK=0 disagrees with OMPI_COMM_WORLD_RANK=1 (Open MPI started"),
    ({**MPICH, "LOCAL_RANK": "1"}, "LOCAL_RANK=1 disagrees with MPI_LOCALRANKID=0"),
    ({**OMPI, "RANK": "0", "WORLD_SIZE": "2"}, "RANK=0 disagrees with OMPI_COMM_WORLD_RANK=1"),
])
def test_mpi_errors(env, message):
    with pytest.raises(EnvError) as info:
        role(env)
    assert message in str(info.value)


# -- parameter-server mode ----------------------------------------------------------------------
def test_ps_script_under_srun_joins_the_collective_job():
    # As under torchrun: no servers listed, several tasks; a job, not four lone "rank 0"s.
    rm = role(SRUN, is_collective=False)
    assert rm.is_collective and summary(rm)[:2] == (3, 4)


def test_ps_script_under_one_task_is_local():
    rm = role({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, is_collective=False)
    assert rm._is_non_distributed() and not rm.is_collective


def test_fleetrun_ps_under_srun_reads_fleetrun_names():
    env = dict(SRUN, TRAINING_ROLE="PSERVER", PADDLE_PSERVERS_IP_PORT_LIST="node01:6000",
               PADDLE_TRAINERS_NUM="2", POD_IP="node01", PADDLE_PORT="6000")
    rm = role(env, is_collective=False)
    assert rm._is_server() and rm._server_index() == 0 and rm._get_master() is None
