"""A mesh that does not fit the devices, the model or the batch is refused before anything is
compiled, with a message naming the numbers."""

import pytest
from jax.sharding import AbstractMesh, AxisType
from rich.console import Console

from ferry.distributed import DistributedConfig, under_slurm
from ferry.models.registry import abstract_model, count_parameters
from ferry.platform import PlatformConfig
from ferry.run.preflight import prepare
from ferry.sharding import MESH_AXES, MeshConfig, MeshError, param_spec, parameters_per_device
from tests.conftest import compose_config, load_model_config, run_launcher


def prepare_with(*overrides: str):
    return prepare(compose_config(*overrides), Console(quiet=True))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.tensor=8"], r"model.num_heads \(4\) is not divisible by mesh.tensor=8"),
        (["mesh.tensor=4"], r"model.num_kv_heads \(2\) is not divisible by mesh.tensor=4"),
        (["model=deepseek_v3_tiny", "mesh.expert=3"], r"model.num_experts \(16\) is not divisible by mesh.expert=3"),
        (
            ["mesh.data=2", "mesh.fsdp=2", "train.global_batch_size=6"],
            r"global_batch_size 6 is not a multiple of the data-parallel size 4 \(data x fsdp x expert",
        ),
        (
            ["mesh.data=2", "train.global_batch_size=8", "train.micro_batch_size=3"],
            r"not a multiple of train.micro_batch_size 3 x data-parallel size 2",
        ),
        (["mesh.data=2"], r"the mesh data=2 x fsdp=1 x tensor=1 x expert=1 has 2 devices but 1 are available"),
    ],
)
def test_bad_mesh_is_refused_naming_the_numbers(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        prepare_with(*overrides, f"run.dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()


def test_a_parameter_dimension_the_mesh_does_not_divide_names_the_parameter():
    mesh = MeshConfig(fsdp=3)
    fake = type("Mesh", (), {"axis_names": ("data", "fsdp", "tensor", "expert"), "shape": mesh.shape})()
    with pytest.raises(MeshError, match=r"parameter .layers.mlp.wo.weight has shape \(2, 192, 64\): dimension 2"):
        param_spec(".layers.mlp.wo.weight", (2, 192, 64), ("mlp", "embed"), fake)


def test_launcher_refuses_a_bad_mesh_before_compiling(tmp_path):
    result = run_launcher("mesh.tensor=3", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "model.num_heads (4) is not divisible by mesh.tensor=3" in " ".join(result.stdout.split())
    assert not (tmp_path / "run").exists()


def test_distributed_settings_go_together_and_slurm_is_recognised():
    with pytest.raises(ValueError, match="go together: set all three, or none"):
        DistributedConfig(coordinator_address="localhost:1234")
    with pytest.raises(ValueError, match=r"process_id 2 must lie in \[0, num_processes=2\)"):
        DistributedConfig("localhost:1234", 2, 2)
    assert under_slurm({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"})
    assert not under_slurm({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"})  # an interactive single task
    assert not under_slurm({})


def test_cpu_devices_belong_to_the_cpu_platform():
    assert "--xla_force_host_platform_device_count=8" in PlatformConfig("cpu", cpu_devices=8).flag_string()
    with pytest.raises(ValueError, match="platform.cpu_devices=8 needs platform=cpu"):
        PlatformConfig("gpu", cpu_devices=8)


def test_fsdp_divides_what_each_device_holds():
    """The memory check counts one device's share: FSDP over 8 splits every matrix 8 ways;
    the norm scales (2 per layer and the final one, 64 each) stay whole."""
    model = abstract_model(load_model_config("llama_tiny"))
    mesh = AbstractMesh((1, 8, 1, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    norms = (2 * 2 + 1) * 64
    assert parameters_per_device(model, mesh) == (count_parameters(model) - norms) // 8 + norms
