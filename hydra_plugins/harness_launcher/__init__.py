"""Hydra finds launchers only under hydra_plugins, and imports every module here while it starts:
harness's launchers' config schemas (hydra/launcher=harness_local, harness_slurm) are registered
here, and the Slurm launcher's class. harness_local is run by the CLI itself (harness/launch/local.py):
Hydra composes its points but never instantiates it."""

from hydra.core.config_store import ConfigStore

from harness.launch.local import HarnessLocalConf
from harness.launch.slurm import HarnessSlurmConf, SlurmArrays


class HarnessSlurmLauncher(SlurmArrays):
    """hydra/launcher=harness_slurm (harness/launch/slurm.py)."""


ConfigStore.instance().store(group="hydra/launcher", name="harness_slurm_schema", node=HarnessSlurmConf,
                             provider="harness")
ConfigStore.instance().store(group="hydra/launcher", name="harness_local_schema", node=HarnessLocalConf,
                             provider="harness")
