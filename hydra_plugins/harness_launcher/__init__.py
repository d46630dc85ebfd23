"""Hydra finds launchers only under hydra_plugins, and imports every module here while it starts:
harness's Slurm launcher and its config schema (hydra/launcher=harness_slurm) are registered here."""

from hydra.core.config_store import ConfigStore

from harness.launch.slurm import HarnessSlurmConf, SlurmArrays


class HarnessSlurmLauncher(SlurmArrays):
    """hydra/launcher=harness_slurm (harness/launch/slurm.py)."""


ConfigStore.instance().store(group="hydra/launcher", name="harness_slurm_schema", node=HarnessSlurmConf,
                             provider="harness")
