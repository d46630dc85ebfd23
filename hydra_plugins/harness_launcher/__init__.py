"""Hydra finds launchers only under hydra_plugins, and imports every module here while it starts:
harness's launchers' config schemas (hydra/launcher=harness_local, harness_slurm) are registered
here, and the launchers' classes. The CLI runs a harness_local sweep itself (harness/launch/local.py);
its class here serves a multirun Hydra drives on its own."""

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.config_store import ConfigStore

from harness.launch.local import HarnessLocalConf
from harness.launch.slurm import HarnessSlurmConf, SlurmArrays


class HarnessLocalLauncher(BasicLauncher):
    """hydra/launcher=harness_local where Hydra itself runs a multirun (the CLI runs such sweeps
    itself: harness/launch/local.py): its jobs one after another, in this process."""

    def __init__(self, workers: int | None = None) -> None:
        super().__init__()
        self.workers = workers


class HarnessSlurmLauncher(SlurmArrays):
    """hydra/launcher=harness_slurm (harness/launch/slurm.py)."""


ConfigStore.instance().store(group="hydra/launcher", name="harness_slurm_schema", node=HarnessSlurmConf,
                             provider="harness")
ConfigStore.instance().store(group="hydra/launcher", name="harness_local_schema", node=HarnessLocalConf,
                             provider="harness")
