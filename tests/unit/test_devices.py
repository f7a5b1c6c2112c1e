"""Device assignment (forge/placement/devices.py) is plain code: tested here with fake GPU and
core counts."""

import pytest

from forge.placement.devices import HostDevices, PlacementError, place, proc_env, release


def gpu_hosts(n: int, gpus: int = 8, cpus: int = 4) -> list[HostDevices]:
    return [HostDevices(f"h{i}", gpus, tuple(range(cpus))) for i in range(n)]


def test_meshes_get_disjoint_gpus_and_ranks_pick_theirs():
    hosts = gpu_hosts(1)
    trainer = place(hosts, num_hosts=1, procs_per_host=4, gpus_per_proc=1, cpus_per_proc=0)
    generator = place(hosts, num_hosts=1, procs_per_host=2, gpus_per_proc=1, cpus_per_proc=0)
    assert trainer.gpus == ((0, 1, 2, 3),) and generator.gpus == ((4, 5),)
    envs = [proc_env(trainer, r, gpu_host=True) for r in range(4)]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1,2,3"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert proc_env(generator, 1, gpu_host=True)["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_multi_gpu_procs_and_multi_host_ranks():
    hosts = gpu_hosts(3)
    p = place(hosts, num_hosts=2, procs_per_host=2, gpus_per_proc=2, cpus_per_proc=0)
    assert p.hosts == (0, 1) and p.gpus == ((0, 1, 2, 3), (0, 1, 2, 3))
    env = proc_env(p, 3, gpu_host=True)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("3", "1", "4")
    q = place(hosts, num_hosts=2, procs_per_host=2, gpus_per_proc=2, cpus_per_proc=0)
    assert q.hosts == (0, 1) and q.gpus == ((4, 5, 6, 7), (4, 5, 6, 7))
    r = place(hosts, num_hosts=1, procs_per_host=1, gpus_per_proc=1, cpus_per_proc=0)
    assert r.hosts == (2,)  # hosts 0 and 1 are full


def test_cpu_only_proc_on_gpu_host_sees_no_gpu():
    hosts = gpu_hosts(1)
    p = place(hosts, num_hosts=1, procs_per_host=1, gpus_per_proc=0, cpus_per_proc=0)
    assert proc_env(p, 0, gpu_host=True)["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in proc_env(p, 0, gpu_host=False)


def test_cpu_pools_are_disjoint_and_set_thread_counts():
    hosts = [HostDevices("laptop", 0, (0, 1, 2, 3))]
    gen = place(hosts, num_hosts=1, procs_per_host=1, gpus_per_proc=0, cpus_per_proc=1)
    trainer = place(hosts, num_hosts=1, procs_per_host=2, gpus_per_proc=0, cpus_per_proc=1)
    assert proc_env(gen, 0, gpu_host=False)["FORGE_CPUS"] == "0"
    envs = [proc_env(trainer, r, gpu_host=False) for r in range(2)]
    assert [e["FORGE_CPUS"] for e in envs] == ["1", "2"]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["1", "1"]
    with pytest.raises(PlacementError, match="free: laptop 0 GPUs/1 cores"):
        place(hosts, num_hosts=1, procs_per_host=2, gpus_per_proc=0, cpus_per_proc=1)


def test_release_makes_devices_reusable():
    hosts = gpu_hosts(1, gpus=2)
    p = place(hosts, num_hosts=1, procs_per_host=2, gpus_per_proc=1, cpus_per_proc=0)
    with pytest.raises(PlacementError, match="needing 1 GPUs.*free: h0 0 GPUs"):
        place(hosts, num_hosts=1, procs_per_host=1, gpus_per_proc=1, cpus_per_proc=0)
    release(hosts, p)
    assert place(hosts, num_hosts=1, procs_per_host=2, gpus_per_proc=1, cpus_per_proc=0).gpus == (
        (0, 1),
    )


def test_too_many_hosts_is_a_clear_error():
    with pytest.raises(PlacementError, match="each of 3 host"):
        place(gpu_hosts(2), num_hosts=3, procs_per_host=1, gpus_per_proc=1, cpus_per_proc=0)
